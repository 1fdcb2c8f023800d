"""The hybrid Muon + AdamW optimizer: right parameters in each, one lr schedule for both, resumable."""

from __future__ import annotations

import copy

import torch

from eagle3_hf.train.optim import HybridMuonAdamW, build_hybrid_optimizer, muon_param_names


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(10, 8)
        self.fc = torch.nn.Linear(8, 8, bias=False)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 10, bias=False)

    def forward(self, ids):
        return self.lm_head(self.norm(self.fc(self.embed_tokens(ids))))


def test_split_and_schedule_reach_both_optimizers():
    torch.manual_seed(0)
    model = _Toy()
    assert muon_param_names(model) == {"fc.weight"}
    opt = build_hybrid_optimizer(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    assert [type(o).__name__ for o in opt.optimizers] == ["Muon", "AdamW"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    sched.step()
    assert [g["lr"] for o in opt.optimizers for g in o.param_groups] == [5e-3, 5e-3]

    ids = torch.randint(0, 10, (32,))
    before = model.fc.weight.detach().clone()
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(model(ids), ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and not torch.equal(before, model.fc.weight)


def test_state_dict_round_trip_resumes_identically():
    torch.manual_seed(0)
    model, ids = _Toy(), torch.randint(0, 10, (16,))

    def train(m, o, steps):
        for _ in range(steps):
            torch.nn.functional.cross_entropy(m(ids), ids).backward()
            o.step()
            o.zero_grad()

    opt = build_hybrid_optimizer(model, 1e-2, 0.0, (0.9, 0.999), 1e-8)
    train(model, opt, 3)
    clone = _Toy()
    clone.load_state_dict(model.state_dict())
    clone_opt = build_hybrid_optimizer(clone, 1e-2, 0.0, (0.9, 0.999), 1e-8)
    clone_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as saved to disk: no shared tensors
    assert isinstance(clone_opt, HybridMuonAdamW)
    train(model, opt, 2)
    train(clone, clone_opt, 2)
    for a, b in zip(model.parameters(), clone.parameters()):
        torch.testing.assert_close(a, b)
