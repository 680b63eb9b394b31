"""Zero bubble's split backward (Note [splitting backward into input and weight passes]): I then W give exactly
backward's gradients, and W walks only the parameters' branches, not the activation path again."""

from __future__ import annotations

import torch
from torch import nn

from engine.pipeline.weight_grads import input_grad


class CountedIdentity(torch.autograd.Function):
    """An identity on the activation path that counts how often backward runs through it."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        CountedIdentity.calls += 1
        return grad


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)
        self.shared = nn.Parameter(torch.randn(8))  # used twice: its branches join the path at two nodes

    def forward(self, x):
        h = CountedIdentity.apply(torch.tanh(self.a(x)))
        h = self.b(self.norm(h)) * self.shared
        return CountedIdentity.apply(h + self.shared)


def test_input_then_weight_pass_equal_one_backward_and_weight_does_not_rewalk_the_activations():
    torch.manual_seed(0)
    stage, x, dy = Stage(), torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    stage(x).backward(dy)
    expected = {n: p.grad.clone() for n, p in stage.named_parameters()}
    expected_input = x.grad.clone()
    stage.zero_grad(set_to_none=True)
    x.grad = None

    CountedIdentity.calls = 0
    out = stage(x)
    grad, weight_pass = input_grad(out, dy, x, list(stage.parameters()))
    assert CountedIdentity.calls == 2  # I: through both identities on the way to the input
    assert all(p.grad is None for p in stage.parameters())
    torch.testing.assert_close(grad, expected_input, rtol=0, atol=0)
    weight_pass.run()
    assert CountedIdentity.calls == 2  # W started at the join nodes: the activation path was not walked again
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-6, atol=1e-7, msg=name)


def test_the_weight_pass_adds_to_gradients_already_there():
    torch.manual_seed(0)
    stage, x, dy = Stage(), torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    stage(x).backward(dy)
    once = {n: p.grad.clone() for n, p in stage.named_parameters()}
    _, weight_pass = input_grad(stage(x), dy, x, list(stage.parameters()))
    weight_pass.run()
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[name], rtol=1e-6, atol=1e-7, msg=name)
