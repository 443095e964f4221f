"""The LLaDA2 trainer's AdamW: gains and biases are not decayed (with QK-norm they set
the attention's temperature), and a state saved by the earlier single-group optimizer
resumes with every moment on its own parameter."""

from __future__ import annotations

import copy

import torch

from lab.training.optim import WEIGHT_DECAY, adamw, load_adamw_state


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.norm = torch.nn.Parameter(torch.ones(6))
        self.proj = torch.nn.Linear(6, 4)  # a matrix and a bias
        self.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)

    def loss(self, ids):
        return self.proj(self.embed(ids) * self.norm).square().mean()


def _steps(model, optim, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        optim.zero_grad()
        model.loss(torch.randint(0, 10, (5,), generator=gen)).backward()
        optim.step()


def test_vectors_are_not_decayed_and_matrices_are():
    torch.manual_seed(0)
    model = Tiny()
    optim = adamw(model, lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a step with no gradient moves only by decay
    optim.step()
    after = dict(model.named_parameters())
    for name in ("norm", "proj.bias", "frozen"):
        assert torch.equal(after[name], before[name]), name
    for name in ("embed.weight", "proj.weight"):
        assert torch.allclose(after[name], before[name] * (1 - 0.1 * WEIGHT_DECAY)), name


def test_single_group_state_resumes_on_the_same_parameters():
    torch.manual_seed(0)
    model = Tiny()
    legacy = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)
    _steps(model, legacy, 3)
    saved = copy.deepcopy(legacy.state_dict())  # as read from disk: shares no tensor with `legacy`
    legacy_moments = {n: legacy.state[p]["exp_avg"].clone() for n, p in model.named_parameters() if p in legacy.state}

    optim = adamw(model, lr=0.01)
    load_adamw_state(optim, model, copy.deepcopy(saved))
    assert [g["weight_decay"] for g in optim.param_groups] == [WEIGHT_DECAY, 0.0]
    for name, p in model.named_parameters():
        if name in legacy_moments:
            assert torch.equal(optim.state[p]["exp_avg"], legacy_moments[name]), name
            assert int(optim.state[p]["step"]) == 3
    # The next step of a matrix is the legacy optimizer's next step on it.
    twin = Tiny()
    twin.load_state_dict(model.state_dict())
    twin_legacy = torch.optim.AdamW(twin.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)
    twin_legacy.load_state_dict(copy.deepcopy(saved))
    _steps(model, optim, 1, seed=7)
    _steps(twin, twin_legacy, 1, seed=7)
    assert torch.allclose(model.proj.weight, twin.proj.weight, rtol=0, atol=1e-7)
    assert torch.allclose(model.embed.weight, twin.embed.weight, rtol=0, atol=1e-7)


def test_two_group_state_round_trips():
    torch.manual_seed(0)
    model = Tiny()
    optim = adamw(model, lr=0.01)
    _steps(model, optim, 2)
    again = adamw(model, lr=0.01)
    load_adamw_state(again, model, copy.deepcopy(optim.state_dict()))
    for p in model.parameters():
        if p in optim.state:
            assert torch.equal(again.state[p]["exp_avg_sq"], optim.state[p]["exp_avg_sq"])
