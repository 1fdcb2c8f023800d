"""SGLang's tree drafting, one request, written from SGLang 0.5.23's source and independently of
eagle3_hf/decoding/tree.py: the reference the `--tree-attention sglang` rule is tested against.

What the source does (sglang/srt/speculative/eagle_worker_v2.py `draft_forward`, spec_utils.py
`select_top_k_tokens`, eagle_utils.py `per_step_draft_out_cache_loc` and `organize_draft_results`,
sglang/kernels/ops/speculative/cache_locs.py `generate_draft_decode_kv_indices`):

- the drafter runs topk decode requests ("slots"); forward i writes slot j's key/value at the slot's own
  entry i (`out_cache_loc.view(bs, topk, steps).permute(2, 0, 1)[i]`);
- slot j's query at forward i reads the context plus entries `seq_len + j * steps + arange(i + 1)`: its own
  slot's earlier entries and itself, whatever tokens sat in that slot before;
- after each forward the K best of the K x K children (cumulative score) become the next slots, best first,
  and the hidden states are re-gathered by parent slot (`flat_cs // topk`); the KV entries are not;
- the tree is the N - 1 best scores of all steps, sorted back to candidate order.

Here every slot runs as its own decode call with its own key/value list, so nothing is shared with the
batched, masked implementation under test.
"""

from __future__ import annotations

import torch


def sglang_draft_tree(drafter, logits: torch.Tensor, hidden: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                      root: int, position: int, steps: int, topk: int, size: int,
                      per_slot_kv: bool = True) -> tuple[list[int], list[int], list[int]]:
    """(tokens, parents, depths) of the drafted tree, node 0 the root. `per_slot_kv=False` gives the rule of an
    engine with correct tree attention (each node reads its true ancestors), for contrast."""
    top_p, top_ids = torch.softmax(logits.float(), -1).topk(topk)  # the root's draft distribution
    cand_tokens = drafter.draft_to_target(top_ids).tolist()
    cand_parent, cand_depth = [-1] * topk, [1] * topk
    score_list = [top_p]
    fed = list(range(topk))  # candidate index of the node in each slot
    scores = top_p
    slot_hidden = [hidden[:, :1]] * topk  # the root's hidden state, repeated per slot
    slot_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(topk)]  # entries per slot
    node_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # candidate -> its key/value (ancestor rule)
    for i in range(steps - 1):
        child_p, child_ids, out_hidden = [], [], []
        for j, node in enumerate(fed):
            if per_slot_kv:
                entries = slot_kv[j]
            else:
                chain, parent = [], cand_parent[node]
                while parent >= 0:
                    chain.append(node_kv[parent])
                    parent = cand_parent[parent]
                entries = chain[::-1]
            past_k = torch.cat([cache[0]] + [k for k, _ in entries], dim=2)
            past_v = torch.cat([cache[1]] + [v for _, v in entries], dim=2)
            ids = torch.tensor([[cand_tokens[node]]])
            step_logits, h, (k, v) = drafter.draft_step(ids, slot_hidden[j], torch.tensor([[position + i]]),
                                                        (past_k, past_v))
            entry = (k[:, :, -1:], v[:, :, -1:])
            slot_kv[j].append(entry)
            node_kv[node] = entry
            p, c = torch.softmax(step_logits[0, -1].float(), -1).topk(topk)
            child_p.append(p)
            child_ids.append(c)
            out_hidden.append(h[:, -1:])
        expanded = scores[:, None] * torch.stack(child_p)  # [K slots, K children]
        first = len(cand_tokens)
        cand_tokens += drafter.draft_to_target(torch.stack(child_ids).flatten()).tolist()
        cand_parent += [fed[j] for j in range(topk) for _ in range(topk)]
        cand_depth += [i + 2] * (topk * topk)
        score_list.append(expanded.flatten())
        scores, best = expanded.flatten().topk(topk)
        fed = [first + int(b) for b in best]
        slot_hidden = [out_hidden[int(b) // topk] for b in best]  # re-gathered by parent slot
    chosen = sorted(torch.cat(score_list).topk(size - 1).indices.tolist())
    index = {c: n + 1 for n, c in enumerate(chosen)}
    return ([root] + [cand_tokens[c] for c in chosen],
            [-1] + [0 if cand_parent[c] < 0 else index[cand_parent[c]] for c in chosen],
            [0] + [cand_depth[c] for c in chosen])
