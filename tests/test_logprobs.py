"""The log-prob of the sampled token (one autograd function, chunked normaliser on a CPU) and the entropy,
against the composed textbook formulas, in float64, float32 and bfloat16; and AdamW's fused kernel on a CPU."""

import pytest
import torch

from lit_grpo.math.logprobs import cpu_chunk_rows, logsumexp_last, selective_log_softmax, token_entropy
from lit_grpo.training.optim import OptimizerArgs, build_optimizer, fuses_on_cpu


def reference_logp(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# a vocabulary wide enough, and enough rows, that the CPU path works in several chunks
WIDE = (3, 40, 20_000)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logp_and_gradient_equal_the_composed_formula_float64(temperature):
    torch.manual_seed(0)
    logits = torch.randn(*WIDE, dtype=torch.float64) * 3
    assert logits.numel() // logits.shape[-1] > cpu_chunk_rows(logits.shape[-1])  # several chunks
    tokens = torch.randint(0, WIDE[-1], WIDE[:2])
    upstream = torch.randn(WIDE[:2], dtype=torch.float64)
    ours = logits.clone().requires_grad_()
    (selective_log_softmax(ours, tokens, temperature) * upstream).sum().backward()
    theirs = logits.clone().requires_grad_()
    (reference_logp(theirs, tokens, temperature) * upstream).sum().backward()
    assert torch.allclose(selective_log_softmax(logits, tokens, temperature),
                          reference_logp(logits, tokens, temperature), atol=1e-12, rtol=0)
    assert torch.allclose(ours.grad, theirs.grad, atol=1e-12, rtol=0)


def test_gradcheck_small():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 11, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 11, (2, 3))
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, tokens, 0.6), (logits,))


def test_float32_close_to_float64():
    torch.manual_seed(2)
    logits = torch.randn(*WIDE, dtype=torch.float64) * 3
    tokens = torch.randint(0, WIDE[-1], WIDE[:2])
    low = logits.float().requires_grad_()
    got = selective_log_softmax(low, tokens)
    got.sum().backward()
    exact = logits.clone().requires_grad_()
    want = reference_logp(exact, tokens, 1.0)
    want.sum().backward()
    assert (got.double() - want).abs().max().item() < 1e-5
    assert (low.grad.double() - exact.grad).abs().max().item() < 1e-6


def test_bfloat16_logits_are_summed_in_float32_and_get_a_bfloat16_gradient():
    torch.manual_seed(3)
    logits = (torch.randn(4, 5, 300) * 4).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 300, (4, 5))
    got = selective_log_softmax(logits, tokens, 0.9)
    assert got.dtype == torch.float32
    want = reference_logp(logits.detach().double(), tokens, 0.9)
    assert (got.double() - want).abs().max().item() < 1e-5  # exact float32 math on the bfloat16 values
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    exact = logits.detach().double().requires_grad_()
    reference_logp(exact, tokens, 0.9).sum().backward()
    assert (logits.grad.double() - exact.grad).abs().max().item() < 1e-2  # bfloat16 rounding of the gradient


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_entropy_equals_minus_sum_p_log_p(temperature):
    torch.manual_seed(4)
    logits = torch.randn(*WIDE, dtype=torch.float64) * 3
    logp = torch.log_softmax(logits / temperature, dim=-1)
    want = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(token_entropy(logits, temperature), want, atol=1e-10, rtol=0)
    normaliser = torch.logsumexp(logits / temperature, dim=-1)
    assert torch.allclose(token_entropy(logits, temperature, normaliser), want, atol=1e-10, rtol=0)
    # float32 logits: the logged statistic stays within 1e-4 nats
    assert (token_entropy(logits.float(), temperature).double() - want).abs().max().item() < 1e-4


def test_chunked_logsumexp_equals_torch():
    torch.manual_seed(5)
    x = torch.randn(7, 33, 30_000)
    assert torch.equal(logsumexp_last(x), torch.logsumexp(x, dim=-1))
    small = torch.randn(3, 4)
    assert torch.equal(logsumexp_last(small), torch.logsumexp(small, dim=-1))


def test_adamw_fused_on_request_steps_like_the_loop_implementation():
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    twin.load_state_dict(model.state_dict())
    default, _ = build_optimizer(twin.parameters(), OptimizerArgs(lr=1e-2), None)
    assert not default.defaults["fused"]  # torch's default loop: the committed curves repeat bit for bit
    fused, _ = build_optimizer(model.parameters(), OptimizerArgs(lr=1e-2, weight_decay=0.1, fused=True), None)
    assert fused.defaults["fused"] is True
    loop = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    x = torch.randn(32, 8)
    for _ in range(5):
        for net, opt in ((model, fused), (twin, loop)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert not fuses_on_cpu([torch.nn.Parameter(torch.zeros(2, dtype=torch.float32, device="meta"))])
    assert not fuses_on_cpu([])
