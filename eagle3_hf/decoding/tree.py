"""Tree drafting as SGLang serves EAGLE-3 (`--speculative-eagle-topk` K > 1): build, verify, accept, sample.

One cycle (docs/contracts.md, "Tree drafting (SGLang semantics)"): S drafting steps grow a tree from the
newest token (the root); step 0 keeps the top-K tokens of the root's draft distribution, each later step
feeds the K kept nodes to the drafter at once (a tree mask on its own cache) and keeps the K best of their
K x K children by cumulative probability; the N - 1 best candidates of all steps plus the root form the tree.
One verifier forward reads the tree on top of its KV cache (each node sees the cache, its ancestors and
itself; positions by depth). Greedy keeps the longest path that matches the verifier's argmax; sampling uses
SGLang's target-only tree rule (exact in distribution). The verifier's cache keeps the accepted path's rows,
gathered out of every layer; the drafter drops its tree entries and reads the verifier's features of the
accepted tokens, as in the chain (the prefill and that commit are core.py's). K = 1 is the chain:
`speculative_decode` (the package's) sends it there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .core import crop, make_rollbackable, new_cache, prefill, prepacked, probabilities, sample, verifier_forward
from .result import SpeculativeResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..model.modeling_eagle3 import Eagle3DraftModel


# ---------------------------------------------------------------- configurations


def num_candidates(steps: int, topk: int) -> int:
    """Nodes the S steps propose: K at step 0, K x K at each later step (SGLang's score list)."""
    return 0 if steps < 1 else topk + (steps - 1) * topk * topk


def config_problem(steps: int, topk: int, num_draft_tokens: int) -> str | None:
    """Why (S, K, N) is not a configuration SGLang serves, or None. N counts the root, as SGLang's
    --speculative-num-draft-tokens does; with K = 1 SGLang forces N = S + 1 (a chain)."""
    if steps < 1 or topk < 1:
        return f"steps ({steps}) and topk ({topk}) must be >= 1"
    if topk == 1 and num_draft_tokens != steps + 1:
        return f"topk 1 is a chain: num_draft_tokens must be steps + 1 = {steps + 1}, not {num_draft_tokens}"
    most = 1 + num_candidates(steps, topk)
    if not 2 <= num_draft_tokens <= most:
        return f"num_draft_tokens {num_draft_tokens} must lie in 2..{most} for steps {steps}, topk {topk}"
    return None


# ---------------------------------------------------------------- the tree


@dataclass
class DraftTree:
    """Node 0 is the root (the newest token, not yet read by the verifier); parents precede children."""

    tokens: list[int]  # verifier ids
    parents: list[int]  # tree index of the parent, -1 for the root
    depths: list[int]  # 0 for the root

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        """Children of each node in tree order (SGLang's sibling order: candidate index ascending)."""
        out: list[list[int]] = [[] for _ in self.tokens]
        for i, parent in enumerate(self.parents[1:], start=1):
            out[parent].append(i)
        return out

    def ancestry(self) -> torch.Tensor:
        """bool [N, N]: [i, j] is True where j is i or one of its ancestors."""
        anc = torch.eye(len(self), dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                anc[i] |= anc[parent]
        return anc


def _order(scores: torch.Tensor) -> torch.Tensor:
    """Indices by score, best first; equal scores keep the lower index first (a stable sort)."""
    return torch.sort(scores, descending=True, stable=True).indices


TREE_ATTENTION = ("sglang", "ancestors")  # --tree-attention: what a drafted node attends to while drafting


def draft_tree(drafter: Eagle3DraftModel, logits: torch.Tensor, hidden: torch.Tensor, cache: Any, root: int,
               position: int, steps: int, topk: int, size: int, attention: str = "sglang") -> DraftTree:
    """Grow the candidates of S steps from the root's draft logits [Vd] and hidden [1, 1, H], pick the tree.

    `cache` is the drafter's (k, v) before the tree; `position` the RoPE position the depth-1 nodes are fed
    at (depth d at position + d - 1, as the chain feeds its drafts). The cache itself is not changed: the tree
    steps extend a copy. Candidate index order is SGLang's: step 0's K, then K x K per step (parent slot, child
    rank); the N - 1 best scores (ties: lower index) are sorted back to index order, so parents come first.

    `attention` is what a node fed at a drafting step attends to besides the context. "sglang": SGLang runs the
    K kept nodes as K decode requests ("slots") and writes each step's key/value at the slot's own entry, never
    reordered when the parents are re-chosen, so slot j reads slot j's earlier entries and itself — from the
    third step on not necessarily its ancestors (SGLang 0.5.23, `generate_draft_decode_kv_indices`; its issue
    7523). "ancestors": its true path, what an engine with correct tree attention does. The hidden state fed is
    the parent's under both (SGLang re-gathers it by parent); verification always reads the true tree.
    """
    if attention not in TREE_ATTENTION:
        raise ValueError(f"tree attention must be one of {TREE_ATTENTION}, not {attention!r}")
    if steps < 1 or size < 2:
        return DraftTree([root], [-1], [0])
    probs, ids = torch.softmax(logits.float(), -1).topk(topk)  # [K], SGLang's fast_topk of the root
    tokens = drafter.draft_to_target(ids).tolist()
    parents, depths, scores = [-1] * topk, [1] * topk, [probs]
    kept, kept_scores = list(range(topk)), probs  # the nodes fed at the next step, best first
    node_hidden = hidden.expand(1, topk, hidden.shape[-1])  # each kept node's parent's hidden state
    base = cache[0].shape[2]
    rows: dict[int, int] = {}  # candidate index -> row in the tree part of the drafter cache
    for step in range(1, steps):
        fed = len(rows)
        allowed = torch.zeros(topk, base + fed + topk, dtype=torch.bool)
        allowed[:, :base] = True
        for j, node in enumerate(kept):
            if attention == "sglang":  # slot j's entries of steps 1 .. step: rows (s - 1) K + j, itself last
                allowed[j, base + j : base + fed + topk : topk] = True
                continue
            allowed[j, base + fed + j] = True
            parent = parents[node]
            while parent >= 0:
                allowed[j, base + rows[parent]] = True
                parent = parents[parent]
        ids = torch.tensor([[tokens[node] for node in kept]], device=node_hidden.device)
        positions = torch.full((1, topk), position + step - 1, device=node_hidden.device)
        step_logits, out_hidden, cache = drafter.draft_step(ids, node_hidden, positions, cache, attention_mask=allowed)
        rows.update({node: fed + j for j, node in enumerate(kept)})
        child_p, child_ids = torch.softmax(step_logits[0].float(), -1).topk(topk)  # [K, K]
        expanded = (kept_scores[:, None] * child_p).flatten()  # [K x K]: parent slot j, child rank c
        first = len(tokens)
        tokens += drafter.draft_to_target(child_ids.flatten()).tolist()
        parents += [kept[j] for j in range(topk) for _ in range(topk)]
        depths += [step + 1] * (topk * topk)
        scores.append(expanded)
        best = _order(expanded)[:topk]
        kept, kept_scores = [first + int(i) for i in best], expanded[best]
        node_hidden = out_hidden[:, best // topk]
    chosen = sorted(_order(torch.cat(scores))[: size - 1].tolist())
    index = {c: i + 1 for i, c in enumerate(chosen)}  # candidate -> tree index
    return DraftTree([root] + [tokens[c] for c in chosen],
                     [-1] + [0 if parents[c] < 0 else index[parents[c]] for c in chosen],
                     [0] + [depths[c] for c in chosen])


# ---------------------------------------------------------------- the verifier over a tree


def _layer_types(verifier: PreTrainedModel) -> list[str]:
    cfg = verifier.config.get_text_config()
    return list(getattr(cfg, "layer_types", None) or ["full_attention"] * int(cfg.num_hidden_layers))


def tree_attention_mask(verifier: PreTrainedModel, tree: DraftTree, cached: int, dtype: torch.dtype,
                        device: torch.device | str) -> Any:
    """The additive 4D mask of a tree read after `cached` positions: a tensor, or per layer type a dict
    (what Gemma 3 / Qwen 3 take) when sliding-window layers keep only their last window - 1 positions."""
    cfg = verifier.config.get_text_config()
    window = int(getattr(cfg, "sliding_window", None) or 0)
    anc = tree.ancestry()
    q_pos = cached + torch.tensor(tree.depths)  # [N]
    masks = {}
    for kind in dict.fromkeys(_layer_types(verifier)):
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"tree drafting supports full and sliding-window attention, not {kind!r} layers")
        sliding = kind == "sliding_attention" and window > 0
        visible = min(cached, window - 1) if sliding else cached
        k_pos = torch.cat([torch.arange(cached - visible, cached), q_pos])  # cache rows, then the tree
        allowed = torch.cat([torch.ones(len(tree), visible, dtype=torch.bool), anc], dim=1)
        if sliding:
            allowed &= k_pos[None] > q_pos[:, None] - window
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        masks[kind] = mask[None, None].to(device)
    return masks if len(masks) > 1 or "sliding_attention" in masks else masks["full_attention"]


# ---------------------------------------------------------------- acceptance


def accept_greedy(tree: DraftTree, choice: Sequence[int]) -> tuple[list[int], int]:
    """choice[i]: the verifier's argmax after node i. -> (accepted path as tree indices, bonus token)."""
    children, node = tree.children(), 0
    path: list[int] = []
    while True:
        nxt = next((c for c in children[node] if tree.tokens[c] == choice[node]), None)
        if nxt is None:
            return path, int(choice[node])
        path.append(nxt)
        node = nxt


def accept_sampled(tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """SGLang's target-only tree sampling; p [N, V] the verifier's probabilities after each node.

    At a node one uniform coin u is drawn; its children c_1, c_2, .. (tree order) are tried in turn and c_j
    accepted when u <= p(c_1) + .. + p(c_j), so c_j wins with probability p(c_j). When none wins, the next
    token is drawn from p with the tried children removed (renormalised): every token keeps probability p.
    A leaf draws from p itself. The drafts are a deterministic function of the drafter, so this is exact.
    """
    children, node = tree.children(), 0
    path: list[int] = []
    while True:
        coin, mass, nxt = float(torch.rand((), dtype=torch.float64, generator=generator)), 0.0, None
        for c in children[node]:
            mass += float(p[node, tree.tokens[c]])
            if coin <= mass:
                nxt = c
                break
        if nxt is None:
            residual = p[node].clone()
            residual[[tree.tokens[c] for c in children[node]]] = 0
            total = residual.sum()
            return path, sample(residual / total if total > 0 else p[node], generator)
        path.append(nxt)
        node = nxt


# ---------------------------------------------------------------- decoding


@prepacked
@torch.inference_mode()
def tree_speculative_generate(verifier: PreTrainedModel, drafter: Eagle3DraftModel,
                              input_ids: Sequence[int] | torch.Tensor, steps: int = 3, topk: int = 4,
                              num_draft_tokens: int = 8, max_new_tokens: int = 64, temperature: float = 0.0,
                              generator: torch.Generator | None = None,
                              eos_token_id: int | Sequence[int] | None = None,
                              tree_attention: str = "sglang") -> SpeculativeResult:
    """Tree speculative decoding (greedy at temperature 0, target-only tree sampling above); `tree_attention`
    is the drafting rule of `draft_tree`.

    The depth is capped near max_new_tokens as the chain caps k. The result's drafted_per_step is the tree's
    depth; it also has tree_size_per_step and verify_seconds (each verifier forward over a tree).
    """
    start = time.perf_counter()
    device = verifier.device
    greedy = temperature <= 0
    mask_dtype = next(verifier.parameters()).dtype
    state = prefill(verifier, drafter, input_ids, max_new_tokens, temperature, generator, eos_token_id)
    sizes: list[int] = []
    verify_seconds: list[float] = []
    while state.running():
        depth = state.budget(steps)
        size = min(num_draft_tokens, 1 + num_candidates(depth, topk))
        tree = draft_tree(drafter, state.draft_logits, state.draft_hidden, state.draft_cache, state.last, state.n,
                          depth, topk, size, tree_attention)
        mask = tree_attention_mask(verifier, tree, state.n, mask_dtype, device)
        positions = (state.n + torch.tensor(tree.depths, device=device))[None]
        began = time.perf_counter()
        v_logits, v_aux = verifier_forward(verifier, torch.tensor([tree.tokens], device=device), state.cache,
                                           state.aux_indices, attention_mask=mask,
                                           position_ids=positions)  # [N, V], [1, N, 3H]
        verify_seconds.append(time.perf_counter() - began)
        if greedy:
            path, bonus = accept_greedy(tree, v_logits.argmax(-1).tolist())
        else:
            path, bonus = accept_sampled(tree, probabilities(v_logits, temperature), generator)
        sizes.append(len(tree))
        state.commit([tree.tokens[i] for i in path], bonus, [0] + path, v_logits, v_aux, depth=max(tree.depths),
                     proposals=tree.tokens[1:], tree_size=len(tree))
    return state.result(start, tree_size_per_step=sizes, verify_seconds=verify_seconds)


# ---------------------------------------------------------------- what a verify forward costs


def cost_tree(size: int) -> DraftTree:
    """A binary-ish tree of `size` nodes (the mask's shape does not change a dense forward's cost)."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, size)]
    depths = [0] * size
    for i in range(1, size):
        depths[i] = depths[parents[i]] + 1
    return DraftTree([0] * size, parents, depths)


@prepacked
@torch.inference_mode()
def verify_costs(verifier: PreTrainedModel, input_ids: Sequence[int] | torch.Tensor, sizes: Sequence[int],
                 reps: int = 15) -> dict[int, float]:
    """Median seconds of a verifier forward over a tree of each size after the prompt's cache, divided by the
    median seconds of a one-token forward at the same context; interleaved so that load drifts evenly. With one
    CPU thread, CPU seconds (other processes on a shared machine do not inflate them); else wall seconds."""
    clock = time.process_time if verifier.device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    device = verifier.device
    prompt = torch.as_tensor(input_ids, dtype=torch.long, device=device).view(1, -1)
    n, dtype = prompt.shape[1], next(verifier.parameters()).dtype
    cache = new_cache(verifier)
    verifier_forward(verifier, prompt, cache, None, last_only=True)
    make_rollbackable(cache)
    times: dict[int, list[float]] = {s: [] for s in [1, *sizes]}
    for _ in range(reps):
        for size in times:
            tree = cost_tree(size)
            mask = tree_attention_mask(verifier, tree, n, dtype, device)
            positions = (n + torch.tensor(tree.depths, device=device))[None]
            began = clock()
            verifier_forward(verifier, torch.full((1, size), int(prompt[0, -1]), device=device), cache, None,
                             attention_mask=mask, position_ids=positions)
            times[size].append(clock() - began)
            crop(cache, n)
    median = {s: sorted(t)[len(t) // 2] for s, t in times.items()}
    return {s: median[s] / median[1] for s in sizes}
