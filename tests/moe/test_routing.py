"""moe_route and moe_sort: the routers of Mixtral, Qwen and DeepSeek-V3 against their PyTorch spec (ids
exactly, weights and the logits' gradient by the 2x/3x rule), the sort by expert exactly, bad input."""

import pytest
import torch
from moe_testing import GRAD_FACTOR, OUTPUT_FACTOR, expect_launches

import accuracy_rule
from llm_speed import moe_route, moe_sort
from llm_speed.core import runtime
from llm_speed.moe import routing
from llm_speed.moe.reference import moe_route_reference, moe_sort_reference

ROUTERS = {
    "mixtral": dict(scoring="softmax", renormalize=True),
    "qwen-no-norm": dict(scoring="softmax", renormalize=False),
    "deepseek-v3": dict(
        scoring="sigmoid", renormalize=True, n_group=4, topk_group=2, routed_scaling_factor=2.5
    ),
    "sigmoid-groups-no-bias": dict(scoring="sigmoid", renormalize=False, n_group=4, topk_group=3),
}
RUNS = [  # router, tokens, experts, top_k, dtype
    ("mixtral", 13, 8, 2, torch.float32),
    ("mixtral", 5, 1, 1, torch.float32),
    ("mixtral", 9, 64, 8, torch.bfloat16),
    ("qwen-no-norm", 17, 64, 8, torch.float32),
    ("qwen-no-norm", 6, 8, 1, torch.float16),
    ("deepseek-v3", 11, 32, 8, torch.float32),
    ("deepseek-v3", 7, 16, 2, torch.bfloat16),
    ("sigmoid-groups-no-bias", 10, 8, 4, torch.float32),
]


@pytest.mark.parametrize(("router", "tokens", "experts", "top_k", "dtype"), RUNS)
def test_route_matches_the_spec(router, tokens, experts, top_k, dtype, device):
    kwargs = dict(ROUTERS[router])
    if router == "deepseek-v3":
        kwargs["bias"] = (torch.randn(experts) * 0.1).to(device)
    logits = (torch.randn(tokens, experts) * 2).to(dtype)
    dweights = torch.randn(tokens, top_k)
    truth_logits = logits.double().requires_grad_()
    truth_kwargs = {k: (v.double().cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    truth_w, truth_ids = moe_route_reference(truth_logits, top_k, **truth_kwargs)
    same_logits = logits.clone().requires_grad_()
    same_kwargs = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    same_w, _ = moe_route_reference(same_logits, top_k, **same_kwargs)
    got_logits = logits.to(device).requires_grad_()
    with expect_launches(routing.ROUTE_FORWARD.name, routing.ROUTE_BACKWARD.name, device=device):
        got_w, got_ids = moe_route(got_logits, top_k, **kwargs)
        (got_w * dweights.to(device)).sum().backward()
    (truth_w * dweights.double()).sum().backward()
    (same_w * dweights).sum().backward()
    assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32
    assert torch.equal(got_ids.cpu(), truth_ids)  # the random logits have no near-ties
    cap = accuracy_rule.ERROR_CAP[torch.float32]
    accuracy_rule.assert_error_rule("weights", got_w, same_w, truth_w, OUTPUT_FACTOR, cap=cap)
    accuracy_rule.assert_error_rule(
        "dlogits", got_logits.grad, same_logits.grad, truth_logits.grad, GRAD_FACTOR,
        cap=accuracy_rule.ERROR_CAP[dtype],
    )  # fmt: skip


@pytest.mark.parametrize("router", ["mixtral", "deepseek-v3"])
def test_a_chosen_expert_whose_weight_gets_no_gradient_still_renormalizes_the_others(router, device):
    """With renormalize, every chosen weight's gradient reaches every chosen logit, a slot whose incoming
    gradient is exactly 0 included (an expert whose down projection is zero, a loss on one slot): the
    backward took a zero gradient for an unchosen column (router logits' gradient off by 0.19 of 0.25)."""
    kwargs = dict(ROUTERS[router])
    if router == "deepseek-v3":
        kwargs["bias"] = torch.randn(16) * 0.1
    logits = torch.randn(6, 16) * 2
    dweights = torch.randn(6, 2)
    dweights[:, 0] = 0.0
    dweights[3] = 0.0
    truth_logits = logits.double().requires_grad_()
    truth_kwargs = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    truth_w, truth_ids = moe_route_reference(truth_logits, 2, **truth_kwargs)
    (truth_w * dweights.double()).sum().backward()
    same_logits = logits.clone().requires_grad_()
    same_w, _ = moe_route_reference(same_logits, 2, **kwargs)
    (same_w * dweights).sum().backward()
    got_logits = logits.to(device).requires_grad_()
    with expect_launches(routing.ROUTE_FORWARD.name, routing.ROUTE_BACKWARD.name, device=device):
        got_w, got_ids = moe_route(got_logits, 2, **{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                                      for k, v in kwargs.items()})  # fmt: skip
        (got_w * dweights.to(device)).sum().backward()
    assert torch.equal(got_ids.cpu(), truth_ids)
    assert truth_logits.grad[:3].abs().amax() > 0.01  # the zero slot's expert is owed a gradient
    accuracy_rule.assert_error_rule("dlogits", got_logits.grad, same_logits.grad, truth_logits.grad,
                                    GRAD_FACTOR, cap=accuracy_rule.ERROR_CAP[torch.float32])  # fmt: skip


def test_sigmoid_scores_that_are_all_zero_renormalize_to_zero_not_nan(device):
    """DeepSeek-V3 divides the chosen sigmoid scores by their sum + 1e-20: logits below about -104 (scores 0
    in float32) give weights 0 and a finite gradient, where a plain division gave 0/0 = NaN (and the MoE
    layer a NaN row); ordinary rows are unchanged."""
    logits = torch.tensor([[-200.0, -300.0, -250.0, -220.0], [0.5, -1.0, 2.0, 0.0]], device=device)
    logits.requires_grad_()
    weights, ids = moe_route(logits, 2, scoring="sigmoid")
    weights.sum().backward()
    assert ids.tolist() == [[0, 1], [2, 0]]  # (all 0 in row 0: ties, the lower ids)
    assert weights[0].tolist() == [0.0, 0.0]
    chosen = torch.sigmoid(torch.tensor([2.0, 0.5]))
    torch.testing.assert_close(weights[1].cpu(), chosen / chosen.sum())
    assert torch.isfinite(logits.grad).all()
    truth, _ = moe_route_reference(logits.detach().cpu().double(), 2, scoring="sigmoid")
    assert torch.isfinite(truth).all() and truth[0].abs().max() < 1e-60  # (float64: scores ~1e-87, not 0)


def test_ties_go_to_the_lower_expert(device):
    logits = torch.zeros(3, 8, device=device)
    weights, ids = moe_route(logits, 3)
    assert ids.tolist() == [[0, 1, 2]] * 3
    torch.testing.assert_close(weights, torch.full((3, 3), 1 / 3, device=device))


@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(40, 2, 8), (300, 3, 8), (9, 8, 64), (1, 1, 1)])
def test_sort_groups_copies_by_expert(tokens, top_k, experts, device):
    ids = torch.randint(0, experts, (tokens, top_k), device=device)
    with expect_launches(routing.SORT_COUNT.name, routing.SORT_PLACE.name, device=device):
        order, offsets, inverse = moe_sort(ids, experts)
    want = moe_sort_reference(ids.cpu(), experts)
    for got, expected in zip((order, offsets, inverse), want, strict=True):
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), expected)
    assert torch.equal(order[inverse.long()].cpu(), torch.arange(tokens * top_k, dtype=torch.int32))


def test_sort_of_no_tokens(device):
    order, offsets, inverse = moe_sort(torch.zeros(0, 2, dtype=torch.int32, device=device), 4)
    assert order.shape == inverse.shape == (0,) and offsets.tolist() == [0, 0, 0, 0]


def test_unchecked_ids_out_of_range_are_sorted_last(monkeypatch, device):
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    ids = torch.tensor([[0, 9], [2, -1], [1, 0]], dtype=torch.int32, device=device)
    order, offsets, inverse = moe_sort(ids, 4)
    assert offsets.tolist() == [2, 3, 4, 4]
    assert order.tolist() == [0, 5, 4, 2, 1, 3]  # experts 0, 1, 2, then the two invalid copies in copy order
    assert inverse.tolist() == [0, 4, 3, 5, 2, 1]


BAD_ROUTE = [
    (lambda x: ((x.long(), 2), {}), TypeError, "router_logits has dtype"),
    (lambda x: ((x[0], 2), {}), ValueError, "router_logits must have 2 dims"),
    (lambda x: ((x, 0), {}), ValueError, "top_k must be a positive int"),
    (lambda x: ((x, 9), {}), ValueError, "top_k \\(9\\) must be at most the number of experts \\(8\\)"),
    (lambda x: ((x, 2), {"scoring": "relu"}), ValueError, "scoring"),
    (lambda x: ((x, 2), {"renormalize": 1}), TypeError, "renormalize must be a bool"),
    (lambda x: ((x, 2), {"bias": torch.zeros(7)}), ValueError, "bias has 7 entries"),
    (lambda x: ((x, 2), {"n_group": 3, "topk_group": 1}), ValueError, "n_group \\(3\\) must divide"),
    (lambda x: ((x, 2), {"n_group": 4}), ValueError, "n_group and topk_group go together"),
    (lambda x: ((x, 2), {"n_group": 4, "topk_group": 5}), ValueError, "topk_group \\(5\\) must be at most"),
    (lambda x: ((x, 6), {"n_group": 4, "topk_group": 2}), ValueError, "top_k \\(6\\) must be at most the"),
    (lambda x: ((x, 2), {"routed_scaling_factor": 0.0}), ValueError, "routed_scaling_factor must be > 0"),
]


@pytest.mark.parametrize(("make", "error", "message"), BAD_ROUTE)
def test_route_bad_input(make, error, message):
    args, kwargs = make(torch.randn(5, 8))
    with pytest.raises(error, match=message):
        moe_route(*args, **kwargs)


def test_sort_bad_input():
    with pytest.raises(ValueError, match="topk_ids must be in \\[0, 4\\).*found 4"):
        moe_sort(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match="found -1"):
        moe_sort(torch.tensor([[-1, 2]]), 4)
    with pytest.raises(TypeError, match="topk_ids has dtype"):
        moe_sort(torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        moe_sort(torch.zeros(2, 2, dtype=torch.int32), 0)


def test_opcheck(device):
    logits = torch.randn(6, 8, device=device, requires_grad=True)
    bias = torch.randn(8, device=device)
    args = (logits, bias, 2, "sigmoid", True, 2, 1, 1.5)
    torch.library.opcheck(torch.ops.llm_speed.moe_route.default, args)
    ids = torch.randint(0, 8, (6, 2), device=device, dtype=torch.int32)
    torch.library.opcheck(torch.ops.llm_speed.moe_sort.default, (ids, 8))
