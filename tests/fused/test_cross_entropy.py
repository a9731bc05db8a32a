"""fused_linear_cross_entropy and cross_entropy: float64 truth (2x/3x), reductions, ignore_index, class
weights, smoothing, softcap, z-loss, loss dtypes, chunking, all-ignored batches, registration, bad input."""

import warnings
import weakref

import pytest
import torch
from fused_testing import DTYPES, GRAD_FACTOR, OUTPUT_FACTOR, assert_error_rule, expect_launches, leaves

import llm_speed.fused.cross_entropy as ce
import llm_speed.fused.cross_entropy_kernels as ck
import llm_speed.fused.cross_entropy_launch as ce_launch
from llm_speed import cross_entropy, fused_linear_cross_entropy
from llm_speed.core import runtime
from llm_speed.core.launch import CallCache
from llm_speed.fused.reference import cross_entropy_reference, fused_linear_cross_entropy_reference
from llm_speed.nn import FusedLinearCrossEntropyLoss

KERNELS = (ck.FORWARD.name, ck.BACKWARD.name)
REDUCE = ck.REDUCE.name


def _problem(n, h, vocab, dtype, device, *, bias=True, ignored=(), magnitude=1.0):
    hidden = (torch.randn(n, h) * magnitude / h**0.5).to(dtype).to(device)
    weight = torch.randn(vocab, h).to(dtype).to(device)
    b = torch.randn(vocab).to(dtype).to(device) if bias else None
    target = torch.randint(0, vocab, (n,))
    target[list(ignored)] = -100
    return hidden, weight, b, target.to(device)


def _run(fn, hidden, weight, bias, target, out_grad, **kw):
    loss = fn(hidden, weight, target, bias=bias, **kw)
    (loss.double() * out_grad).sum().backward()
    grads = (hidden.grad, weight.grad) + ((bias.grad,) if bias is not None else ())
    return (loss.detach(), *grads)


CASES = [  # n, h, vocab, bias, ignored rows, kwargs, magnitude
    (19, 48, 150, True, (3, 17), {}, 1.0),
    (1, 40, 100, False, (), {"reduction": "sum"}, 1.0),
    (13, 56, 190, True, (0,), {"label_smoothing": 0.1, "softcap": 3.0, "chunk_rows": 5}, 4.0),
    (9, 40, 130, False, (1, 2), {"reduction": "none", "label_smoothing": 0.25, "chunk_rows": 4}, 8.0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_accuracy(case, dtype, device):
    n, h, vocab, bias, ignored, kw, magnitude = case
    hidden, weight, b, target = _problem(
        n, h, vocab, dtype, device, bias=bias, ignored=ignored, magnitude=magnitude
    )
    # a reduced loss's gradient not 1: the backward scales the gradients made in the forward
    out_grad = torch.randn(n).double() if kw.get("reduction") == "none" else torch.tensor(0.7).double()
    tensors = [t for t in (hidden, weight, b) if t is not None]

    def split(ts):
        return ts[0], ts[1], (ts[2] if bias else None)

    truth = _run(fused_linear_cross_entropy_reference, *split(leaves(*tensors, dtype=torch.float64)),
                 target.cpu(), out_grad, **{k: v for k, v in kw.items() if k != "chunk_rows"})  # fmt: skip
    same = _run(fused_linear_cross_entropy_reference, *split(leaves(*tensors)), target, out_grad.to(device),
                **{k: v for k, v in kw.items() if k != "chunk_rows"})  # fmt: skip
    with expect_launches(*KERNELS, device=device):
        got = _run(fused_linear_cross_entropy, *split(leaves(*tensors)), target, out_grad.to(device), **kw)
    # the loss is float32 by default, whatever the inputs' dtype (as Hugging Face's and Liger's)
    assert got[0].dtype == torch.float32 and got[0].shape == ((n,) if kw.get("reduction") == "none" else ())
    for i, name in enumerate(("loss", "dhidden", "dweight", "dbias")[: len(got)]):
        factor = OUTPUT_FACTOR if i == 0 else GRAD_FACTOR
        # the loss is of order log(V) (more with large logits): the cap is one rounding unit at that size
        assert_error_rule(name, got[i], same[i], truth[i], factor, dtype, scale=8.0 if i == 0 else 1.0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_batch_gives_zero_loss_and_gradients(reduction, device):
    hidden, weight, b, target = _problem(5, 40, 101, torch.float32, device, ignored=range(5))
    hidden, weight, b = leaves(hidden, weight, b)
    loss = fused_linear_cross_entropy(hidden, weight, target, bias=b, reduction=reduction)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss))
    for t in (hidden, weight, b):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_no_rows_gives_zero_loss(device):
    hidden = torch.randn(0, 8, device=device, requires_grad=True)
    weight = torch.randn(10, 8, device=device, requires_grad=True)
    loss = fused_linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.int64, device=device))
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.shape == (0, 8) and not weight.grad.any()


def test_chunks_never_hold_full_logits_and_memory_formula(monkeypatch, device):
    shapes = []
    original = ce_launch._chunk_logits

    def recording(*args):
        out = original(*args)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(ce_launch, "_chunk_logits", recording)
    hidden, weight, b, target = _problem(23, 40, 160, torch.float32, device)
    hidden.requires_grad_()
    fused_linear_cross_entropy(hidden, weight, target, bias=b, chunk_rows=8).backward()
    # a reduced loss with grad makes each chunk's logits once (its gradients with them); "none" twice
    assert shapes and all(rows <= 8 for rows, _ in shapes) and len(shapes) == 3
    rows = fused_linear_cross_entropy(hidden, weight, target, bias=b, chunk_rows=8, reduction="none")
    rows.sum().backward()
    assert all(rows <= 8 for rows, _ in shapes) and len(shapes) == 3 + 2 * 3  # 3 chunks, fwd and bwd
    # The default: logits as large as hidden (Liger's rule), never under 2^16 logits nor 1024 rows, at most N.
    assert ce.default_chunk_rows(23, 40, 160) == 23  # 2^16 / 160 -> 512 rows: one chunk
    assert ce.default_chunk_rows(100_000, 64, 4096) == 2048  # 100000 / ceil(4096 / 64) -> 1563 -> 2048
    assert ce.default_chunk_rows(8192, 4096, 128256) == 1024  # Liger's 256: memory-bound GEMMs
    assert ce.default_chunk_rows(2048, 4096, 128256) == 1024  # Liger's 64
    assert ce.default_chunk_rows(600, 4096, 128256) == 600
    llama = ce.memory_estimate(8192, 4096, 128256, itemsize=2)
    assert llama["chunk_rows"] == 1024 and llama["unfused_bytes"] == 2 * 8192 * 128256 * 2
    assert llama["fused_bytes"] == 1024 * 128256 * 2 + 8 * 8192 and round(llama["saving"]) == 16


def test_one_chunk_of_logits_at_a_time(monkeypatch, device):
    # A chunk's logits are dropped before the next chunk's GEMM makes its own, forward and backward: a loop
    # whose name still holds the last chunk while the next is made keeps two (+1 chunk at the peak: 263 MB at
    # Llama-3-8B's head, N = 8192).
    alive_at_each_chunk, made = [], []
    original = ce_launch._chunk_logits

    def recording(*args):
        alive_at_each_chunk.append(sum(ref() is not None for ref in made))
        out = original(*args)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(ce_launch, "_chunk_logits", recording)
    hidden, weight, b, target = _problem(23, 40, 160, torch.float32, device)
    hidden.requires_grad_()
    fused_linear_cross_entropy(hidden, weight, target, bias=b, chunk_rows=8).backward()
    rows = fused_linear_cross_entropy(hidden, weight, target, bias=b, chunk_rows=8, reduction="none")
    rows.sum().backward()
    assert alive_at_each_chunk == [0] * (3 + 6)  # the gradients made in the forward, then fwd and bwd


def test_a_reduced_loss_with_grad_makes_its_gradients_in_the_forward(device):
    # mean and sum: each chunk's d loss / d logits and its two GEMMs run while the chunk's logits exist (the
    # backward then only multiplies by the loss gradient, in place); the gradients match the recomputing path
    hidden, weight, b, target = _problem(23, 40, 160, torch.float32, device, ignored=(5,))
    for reduction in ("mean", "sum"):
        h, w, bb = leaves(hidden, weight, b)
        counts = {k: runtime.launch_count(k) for k in (ck.BACKWARD.name, ck.SCALE.name, ck.REDUCE.name)}
        loss = fused_linear_cross_entropy(h, w, target, bias=bb, chunk_rows=8, reduction=reduction)
        after_forward = {k: runtime.launch_count(k) - c for k, c in counts.items()}
        (loss * 0.7).backward()
        after_backward = {k: runtime.launch_count(k) - c for k, c in counts.items()}
        if runtime.triton_runs_on(device):
            # 3 chunks; the divisors before the first chunk's gradients, the sums after the last chunk's row
            assert after_forward == {ck.BACKWARD.name: 3, ck.SCALE.name: 0, ck.REDUCE.name: 2}
            assert after_backward == {ck.BACKWARD.name: 3, ck.SCALE.name: 3, ck.REDUCE.name: 2}  # dh, dw, db
        # the path that makes the logits again (the backward of reduction="none" with the same gradient)
        h2, w2, b2 = leaves(hidden, weight, b)
        rows = fused_linear_cross_entropy(h2, w2, target, bias=b2, chunk_rows=8, reduction="none")
        scale = 0.7 / (22 if reduction == "mean" else 1)  # one row ignored
        (rows.sum() * scale).backward()
        pairs = (("dh", h.grad, h2.grad), ("dw", w.grad, w2.grad), ("db", bb.grad, b2.grad))
        for name, got, expected in pairs:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_gradients_made_in_the_forward_survive_a_second_backward(device):
    # retain_graph: the first backward hands the kept gradients over (scaled in place); the second makes them
    # again from the saved inputs, so both are right
    hidden, weight, b, target = _problem(13, 24, 70, torch.float32, device)
    h, w, bb = leaves(hidden, weight, b)
    loss = fused_linear_cross_entropy(h, w, target, bias=bb, chunk_rows=4, label_smoothing=0.1)
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (h, w, bb)]
    (2.5 * loss).backward()
    for name, one, both in zip(("dh", "dw", "db"), first, (h.grad, w.grad, bb.grad), strict=True):
        torch.testing.assert_close(both, 3.5 * one, rtol=1e-5, atol=1e-6, msg=name)
    truth = _run(fused_linear_cross_entropy_reference, *leaves(hidden, weight, b, dtype=torch.float64),
                 target.cpu(), torch.tensor(1.0).double(), label_smoothing=0.1)  # fmt: skip
    for name, got, expected in zip(("dh", "dw", "db"), first, truth[1:], strict=True):
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_a_frozen_input_gets_no_gradient_and_costs_no_gemm(frozen, device):
    hidden, weight, _, target = _problem(13, 24, 70, torch.float32, device, bias=False)
    h, w = leaves(hidden, weight)
    (w if frozen == "weight" else h).requires_grad_(False)
    fused_linear_cross_entropy(h, w, target, chunk_rows=4).backward()
    h2, w2 = leaves(hidden, weight)
    fused_linear_cross_entropy(h2, w2, target, chunk_rows=4, reduction="none").mean().backward()
    kept, other = ((h, h2), w) if frozen == "weight" else ((w, w2), h)
    assert other.grad is None
    torch.testing.assert_close(kept[0].grad, kept[1].grad, rtol=1e-5, atol=1e-6)
    args = (hidden, weight, target, None, None, -100, 0.0, 0.0, 0.0, 4, "mean", torch.float32, False)
    *_, dh, dw, db = ce_launch.linear_forward_grads(*args, frozen == "weight", frozen == "hidden", False)
    assert (dh.numel() > 0, dw.numel() > 0, db.numel()) == (frozen == "weight", frozen == "hidden", 0)
    with pytest.raises(ValueError, match="reduction='none' takes its per-row gradient in the backward"):
        ce_launch.linear_forward_grads(*args[:10], "none", *args[11:], True, True, False)


def test_shifting_logits_changes_nothing(device):
    # a constant added to every logit of a row (a bias shift) leaves the loss and dhidden unchanged
    hidden, weight, b, target = _problem(6, 40, 120, torch.float32, device)
    base = fused_linear_cross_entropy(hidden, weight, target, bias=b)
    shifted = fused_linear_cross_entropy(hidden, weight, target, bias=b + 1e3)
    torch.testing.assert_close(base, shifted, rtol=1e-4, atol=1e-4)


def test_opcheck_and_compile_fullgraph(device):
    hidden, weight, b, target = _problem(3, 8, 20, torch.float32, device, ignored=(2,))
    hidden, weight, b = leaves(hidden, weight, b)
    grads = {"none": torch.randn(3, device=device), "mean": torch.randn((), device=device)}
    for reduction, grad in grads.items():
        class_weight = torch.rand(20, device=device) + 0.5
        forward = torch.ops.llm_speed.fused_linear_cross_entropy_forward
        args = (hidden, weight, target, b, class_weight, -100, 0.1, 2.0, 1e-3, 2, reduction, torch.float32,
                True, False, False, False)  # fmt: skip
        torch.library.opcheck(forward.default, args)
        stats = forward(*(a.detach() if torch.is_tensor(a) else a for a in args))[2]
        grad_args = (grad, hidden.detach(), weight.detach(), target, b.detach(), class_weight, stats)
        torch.library.opcheck(
            torch.ops.llm_speed.fused_linear_cross_entropy_backward.default,
            (*grad_args, -100, 0.1, 2.0, 1e-3, 2, reduction),
        )
        torch.library.opcheck(  # dweight summed in float32 (accum_dtype)
            torch.ops.llm_speed.fused_linear_cross_entropy_backward.default,
            (*grad_args, -100, 0.1, 2.0, 1e-3, 2, reduction, True),
        )
        if reduction != "none":  # a reduced loss with grad: the gradients made in the forward, then scaled
            args = (*args[:-3], True, True, True)
            torch.library.opcheck(forward.default, args)
            torch.library.opcheck(forward.default, (*args, True))
            grads = forward(*(a.detach() if torch.is_tensor(a) else a for a in args))[3:]
            torch.library.opcheck(
                torch.ops.llm_speed.fused_linear_cross_entropy_scale_grads.default,
                (grad, *grads),
            )
        logits = torch.randn(3, 20, device=device, requires_grad=True)
        args = (logits, target, class_weight, -100, 0.1, 2.0, 1e-3, reduction, torch.bfloat16, False)
        torch.library.opcheck(torch.ops.llm_speed.cross_entropy_forward.default, args)
        _, _, stats = torch.ops.llm_speed.cross_entropy_forward(logits.detach(), *args[1:])
        torch.library.opcheck(
            torch.ops.llm_speed.cross_entropy_backward.default,
            (grad, logits.detach(), target, class_weight, stats, -100, 0.1, 2.0, 1e-3, reduction),
        )
    torch._dynamo.reset()

    def loss_fn(hh, ww, bb):
        return fused_linear_cross_entropy(hh, ww, target, bias=bb, label_smoothing=0.1, softcap=2.0)

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    torch._dynamo.utils.warn_once_cache.clear()  # dynamo warns once a process (another test may have)
    with warnings.catch_warnings(record=True) as caught, expect_launches(*KERNELS, device=device):
        warnings.simplefilter("always")
        compiled(hidden, weight, b).backward()
    assert not [w for w in caught if "lru_cache" in str(w.message)]  # nothing about our caches reaches users
    grads = [t.grad.clone() for t in (hidden, weight, b)]
    for t in (hidden, weight, b):
        t.grad = None
    loss_fn(hidden, weight, b).backward()
    torch.testing.assert_close(grads, [t.grad for t in (hidden, weight, b)], rtol=0, atol=0)


def _bad(**changes):
    args = dict(hidden=torch.ones(3, 8), weight=torch.ones(10, 8), target=torch.tensor([1, 2, -100]))
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (_bad(target=torch.tensor([1, 10, 0])), ValueError, r"target holds 10; accepted: 0 <= target < 10"),
        (_bad(target=torch.tensor([1, -1, 0])), ValueError, "target holds -1"),
        (_bad(target=torch.tensor([1, 2, 3], dtype=torch.int32)), TypeError, "target has dtype"),
        (_bad(target=torch.tensor([1, 2])), ValueError, "target has 2 entries"),
        (_bad(hidden=torch.ones(3, 8, dtype=torch.float16)), TypeError, "share one dtype"),
        (_bad(hidden=torch.ones(3, 2, 8)), ValueError, r"hidden must have 2 dims"),
        (_bad(weight=torch.ones(10, 7)), ValueError, r"\[V, H\]"),
        (_bad(bias=torch.ones(9)), ValueError, "bias has 9 entries"),
        (_bad(reduction="avg"), ValueError, "reduction is 'avg'"),
        (_bad(label_smoothing=1.5), ValueError, "label_smoothing must be <= 1"),
        (_bad(softcap=0.0), ValueError, "softcap must be > 0"),
        (_bad(ignore_index=-100.0), TypeError, "ignore_index must be an int"),
        (_bad(chunk_rows=0), ValueError, "chunk_rows must be a positive int, got 0"),
        (_bad(chunk_rows=2.0), TypeError, "chunk_rows must be an int"),
        (_bad(ce_weight=torch.ones(9)), ValueError, "ce_weight has 9 entries"),
        (_bad(ce_weight=torch.ones(10, dtype=torch.int64)), TypeError, "ce_weight has dtype"),
        # (PyTorch refuses a weight that requires grad; accepted, it got none, silently)
        (_bad(ce_weight=torch.ones(10, requires_grad=True)), ValueError, "ce_weight gets no gradient here"),
        (_bad(lse_square_scale=-1e-4), ValueError, "lse_square_scale must be >= 0"),
        (_bad(return_z_loss=1), TypeError, "return_z_loss must be a bool"),
        (_bad(loss_dtype=torch.float64), TypeError, "loss_dtype is torch.float64"),
        (_bad(accum_dtype=torch.float64), TypeError, r"accum_dtype is torch.float64; accepted: None"),
    ],
)
def test_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        fused_linear_cross_entropy(**args)


@pytest.mark.parametrize("softcap", [30.0, 50.0])
def test_float32_softcap_is_accurate_for_small_logits(softcap, device):
    # z / softcap well inside (-0.25, 0.25): 1 - 2 / (exp(2x) + 1) loses digits there (about softcap * 6e-8 in
    # every logit); core.kernel_math.tanh does not
    hidden, weight, _, target = _problem(16, 32, 100, torch.float32, device, bias=False)
    out_grad = torch.randn(16).double()
    kw = {"reduction": "none", "softcap": softcap}
    reference = fused_linear_cross_entropy_reference
    truth = _run(reference, *leaves(hidden, weight, dtype=torch.float64), None, target.cpu(), out_grad, **kw)
    same = _run(reference, *leaves(hidden, weight), None, target, out_grad.to(device), **kw)
    with expect_launches(*KERNELS, device=device):
        got = _run(
            fused_linear_cross_entropy, *leaves(hidden, weight), None, target, out_grad.to(device), **kw
        )
    assert_error_rule("loss", got[0], same[0], truth[0], OUTPUT_FACTOR, torch.float32)
    for i, name in ((1, "dhidden"), (2, "dweight")):
        assert_error_rule(name, got[i], same[i], truth[i], GRAD_FACTOR, torch.float32)


BAD_ROWS = (2, 5, 7)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_unchecked_bad_target_gives_nan_rows_and_reads_nothing_out_of_bounds(reduction, monkeypatch, device):
    # with the host checks off (the default on CUDA) nothing reads the targets on the host: a target outside
    # [0, V) makes its row's loss and hidden gradient NaN; no kernel uses it as an address (2**40 would fault)
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    hidden, weight, b, target = _problem(9, 40, 50, torch.float32, device, ignored=(0,))
    bad = target.clone()
    bad[list(BAD_ROWS)] = torch.tensor([50, -5, 2**40], device=device)
    good = target.clone()
    good[list(BAD_ROWS)] = -100  # the same rows, ignored
    runs = []
    for t in (bad, good):
        h, w, bb = leaves(hidden, weight, b)
        with expect_launches(*KERNELS, device=device):
            loss = fused_linear_cross_entropy(h, w, t, bias=bb, reduction=reduction, chunk_rows=4)
            loss.sum().backward()
        runs.append((loss.detach(), h.grad, w.grad))
    (loss_bad, dh_bad, dw_bad), (loss_good, dh_good, _) = runs
    rows = torch.zeros(9, dtype=torch.bool)
    rows[list(BAD_ROWS)] = True
    if reduction == "none":
        assert torch.isnan(loss_bad[rows]).all() and torch.equal(loss_bad[~rows], loss_good[~rows])
    else:
        assert torch.isnan(loss_bad) and torch.isfinite(loss_good)
    assert torch.isnan(dh_bad[rows]).all() and torch.isnan(dw_bad).all()
    if reduction != "mean":  # mean divides by the rows not ignored: the bad rows count there
        assert torch.equal(dh_bad[~rows], dh_good[~rows])
    assert torch.isfinite(dh_bad[~rows]).all()


def test_bad_target_raises_where_values_are_checked(monkeypatch, device):
    hidden, weight, _, target = _problem(4, 8, 10, torch.float32, device)
    target[1] = 10
    monkeypatch.setattr(runtime, "CHECK_INPUTS", True)
    before = runtime.launch_counts()
    with pytest.raises(ValueError, match="target holds 10"):
        fused_linear_cross_entropy(hidden, weight, target)
    assert runtime.launch_counts() == before  # before any work
    # the PyTorch fallback (CPU without the interpreter) reads the targets freely: it always checks
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    monkeypatch.setattr(runtime, "triton_runs_on", lambda device: False)
    with pytest.raises(ValueError, match="target holds 10"):
        fused_linear_cross_entropy(hidden.cpu(), weight.cpu(), target.cpu())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reduction_kernel_and_fallback_match_the_reference(reduction, monkeypatch, device):
    # float32: the Triton path (the reduction kernel for "mean" and "sum") and the PyTorch fallback (CPU
    # without the interpreter), forward and backward, against the reference in the same precision
    hidden, weight, b, target = _problem(11, 24, 70, torch.float32, device, ignored=(4,))
    out_grad = (torch.randn(11).double() if reduction == "none" else torch.tensor(1.5).double()).to(device)
    kw = {"reduction": reduction, "label_smoothing": 0.2, "softcap": 5.0}
    expected = _run(fused_linear_cross_entropy_reference, *leaves(hidden, weight, b), target, out_grad, **kw)
    kernels = KERNELS if reduction == "none" else (*KERNELS, REDUCE)
    with expect_launches(*kernels, device=device):
        got = _run(
            fused_linear_cross_entropy, *leaves(hidden, weight, b), target, out_grad, chunk_rows=4, **kw
        )
    monkeypatch.setattr(runtime, "triton_runs_on", lambda device: False)
    fallback = _run(
        fused_linear_cross_entropy, *leaves(hidden, weight, b), target, out_grad, chunk_rows=4, **kw
    )
    for name, g, f, e in zip(("loss", "dhidden", "dweight", "dbias"), got, fallback, expected, strict=True):
        assert g.dtype == f.dtype == e.dtype and g.shape == f.shape == e.shape, name
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(f, e, rtol=1e-5, atol=1e-6, msg=name)


# --- class weights, z-loss, loss dtype, and cross_entropy on logits ---------------------------------------


def _ce_run(fn, logits, target, out_grad, **kw):
    out = fn(logits, target, **kw)
    loss, z = out if kw.get("return_z_loss") else (out, None)
    (loss.double() * out_grad).sum().backward()
    return (loss.detach(), logits.grad) + ((z,) if z is not None else ())


LOSS_CASES = [  # n, vocab, class weights, ignored rows, kwargs, magnitude
    (13, 70, True, (2, 9), {"label_smoothing": 0.2}, 2.0),
    (9, 130, True, (0,), {"reduction": "sum", "lse_square_scale": 1e-2, "return_z_loss": True}, 4.0),
    (11, 61, False, (), {"reduction": "none", "softcap": 5.0, "lse_square_scale": 1e-3}, 8.0),
    (7, 100, True, (1, 2, 3), {"reduction": "none", "label_smoothing": 0.1, "return_z_loss": True}, 1.0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LOSS_CASES)
def test_cross_entropy_on_logits_accuracy(case, dtype, device):
    n, vocab, weighted, ignored, kw, magnitude = case
    logits = (torch.randn(n, vocab) * magnitude).to(dtype).to(device)
    target = torch.randint(0, vocab, (n,))
    target[list(ignored)] = -100
    target = target.to(device)
    weight = (torch.rand(vocab) + 0.5).to(device) if weighted else None
    out_grad = torch.randn(n).double() if kw.get("reduction") == "none" else torch.tensor(0.7).double()
    truth = _ce_run(cross_entropy_reference, *leaves(logits, dtype=torch.float64), target.cpu(), out_grad,
                    weight=None if weight is None else weight.double().cpu(), **kw)  # fmt: skip
    same = _ce_run(cross_entropy_reference, *leaves(logits), target, out_grad.to(device), weight=weight, **kw)
    kernels = (*KERNELS, REDUCE) if kw.get("reduction", "mean") != "none" else KERNELS
    with expect_launches(*kernels, device=device):
        got = _ce_run(cross_entropy, *leaves(logits), target, out_grad.to(device), weight=weight, **kw)
    assert got[0].dtype == torch.float32 and got[1].dtype == dtype
    for i, name in enumerate(("loss", "dlogits", "z_loss")[: len(got)]):
        factor = GRAD_FACTOR if i == 1 else OUTPUT_FACTOR
        assert_error_rule(name, got[i], same[i], truth[i], factor, dtype, scale=8.0 if i != 1 else 1.0)


def test_matches_torch_cross_entropy_with_weights_and_smoothing(device):
    # PyTorch's semantics exactly where PyTorch defines them (float64, so any difference is a formula's)
    logits = torch.randn(10, 33, dtype=torch.float64) * 3
    target = torch.randint(0, 33, (10,))
    target[4] = -100
    weight = torch.rand(33, dtype=torch.float64) + 0.1
    for reduction in ("mean", "sum", "none"):
        kw = dict(weight=weight, reduction=reduction, label_smoothing=0.15)
        expected = torch.nn.functional.cross_entropy(logits, target, **kw)
        torch.testing.assert_close(cross_entropy_reference(logits, target, **kw), expected)
        got = cross_entropy(
            logits.float().to(device), target.to(device), **{**kw, "weight": weight.float().to(device)}
        )
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-5)


# (each reduction once and each dtype once: the four pairs cost ~30 s of CI's interpreter time)
@pytest.mark.parametrize(("reduction", "dtype"), [("mean", torch.bfloat16), ("none", torch.float16)])
def test_float32_accumulation_keeps_pytorchs_weight_gradient_error_over_many_chunks(reduction, dtype, device):
    # 64 chunks: summed in the weight's 16-bit dtype, dweight's error grows with their number (4-6x PyTorch's
    # here); accum_dtype=torch.float32 (Liger's option) rounds each chunk's product once into a float32 sum:
    # within the 3x rule, and the gradient in weight's dtype, the module's option too
    n, vocab, h = 1024, 64, 16
    hidden = torch.randn(n, h).to(dtype).to(device)
    weight = (torch.randn(vocab, h) / 4).to(dtype).to(device)
    target = torch.randint(0, vocab, (n,)).to(device)
    out_grad = torch.randn(n) if reduction == "none" else torch.tensor(1.0)
    w64 = weight.detach().cpu().double().requires_grad_()
    F, t = torch.nn.functional, target.cpu()
    F.cross_entropy(hidden.cpu().double() @ w64.T, t, reduction=reduction).backward(out_grad.double())
    same = weight.detach().cpu().clone().requires_grad_()
    F.cross_entropy(F.linear(hidden.cpu(), same).float(), t, reduction=reduction).backward(out_grad)
    loss_module = FusedLinearCrossEntropyLoss(reduction=reduction, chunk_rows=16, accum_dtype=torch.float32)
    for run in (fused_linear_cross_entropy, loss_module):
        w = weight.detach().clone().requires_grad_()
        with expect_launches(*KERNELS, device=device):
            if run is loss_module:
                loss = run(hidden, w, target)
            else:
                loss = run(hidden, w, target, reduction=reduction, chunk_rows=16, accum_dtype=torch.float32)
            loss.backward(out_grad.to(device))
        assert w.grad.dtype == dtype
        assert_error_rule("dweight", w.grad, same.grad, w64.grad, GRAD_FACTOR, dtype)


@pytest.mark.parametrize("vocab", [10, 4100], ids=["one-block", "first-block-masked"])
def test_minus_infinity_logits_give_pytorchs_loss_and_gradient(vocab, device):
    """Masked classes (-inf logits) as F.cross_entropy treats them: finite loss and gradient without
    smoothing, inf with it, inf for a -inf target, NaN for a row with no finite logit. With vocab 4100 the
    first 4096 (one block) of rows 0-2 are -inf: the online softmax's running max is -inf for a whole
    block."""
    logits = torch.randn(5, vocab, dtype=torch.float64) * 2
    masked = slice(0, 4096) if vocab > 4096 else slice(6, 8)
    logits[:3, masked] = float("-inf")
    logits[4] = float("-inf")
    target = torch.tensor([vocab - 1, vocab - 3, masked.start, vocab - 2, 1])
    weight = torch.rand(vocab, dtype=torch.float64) + 0.1
    out_grad = torch.randn(5, dtype=torch.float64)
    for kw in ({}, {"label_smoothing": 0.1}, {"weight": weight}, {"weight": weight, "label_smoothing": 0.2}):
        x, y = logits.float().to(device).requires_grad_(), logits.clone().requires_grad_()
        given = {k: v.float().to(device) if torch.is_tensor(v) else v for k, v in kw.items()}
        with expect_launches(*KERNELS, device=device):
            got = cross_entropy(x, target.to(device), reduction="none", **given)
            got.backward(out_grad.float().to(device))
        expected = torch.nn.functional.cross_entropy(y, target, reduction="none", **kw)
        expected.backward(out_grad)
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(x.grad.double().cpu(), y.grad, rtol=1e-4, atol=1e-6, equal_nan=True)
        if not kw:  # the reduced loss over the rows with a finite loss
            keep = torch.tensor([True, True, False, True, False])
            mean = cross_entropy(x.detach()[keep.to(device)], target[keep].to(device))
            torch.testing.assert_close(mean.double().cpu(), expected[keep].mean(), rtol=1e-5, atol=1e-5)


def test_fused_linear_masked_classes_by_a_minus_infinity_bias(device):
    hidden, weight, b, target = _problem(7, 32, 50, torch.float32, device)
    b = b.clone()
    b[-5:] = float("-inf")  # classes the head never predicts
    target = target.clamp(max=44)
    loss = fused_linear_cross_entropy(hidden, weight, target, bias=b)
    expected = torch.nn.functional.cross_entropy(hidden.double() @ weight.double().T + b.double(), target)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)


def test_fused_linear_class_weights_and_z_loss_match_the_reference(device):
    hidden, weight, b, target = _problem(21, 40, 90, torch.float32, device, ignored=(3, 4))
    ce_weight = (torch.rand(90) + 0.5).to(device)
    kw = dict(label_smoothing=0.1, lse_square_scale=1e-2, return_z_loss=True, softcap=4.0)
    results = []
    ours = (fused_linear_cross_entropy, {"chunk_rows": 8})
    for fn, extra in ((fused_linear_cross_entropy_reference, {}), ours):
        h, w, bb = leaves(hidden, weight, b)
        loss, z = fn(h, w, target, bias=bb, ce_weight=ce_weight, **kw, **extra)
        # for logging: included in the loss, no gradient of its own
        assert fn is fused_linear_cross_entropy_reference or not z.requires_grad
        loss.backward()
        results.append((loss.detach(), z, h.grad, w.grad, bb.grad))
    for name, got, expected in zip(("loss", "z", "dh", "dw", "db"), results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)
    assert results[1][1] > 0 and results[1][0] > results[1][1]


@pytest.mark.parametrize("loss_dtype", [torch.bfloat16, torch.float16])
def test_loss_in_the_inputs_dtype_on_request(loss_dtype, device):
    hidden, weight, _, target = _problem(6, 16, 50, loss_dtype, device, bias=False)
    loss = fused_linear_cross_entropy(hidden, weight, target, loss_dtype=loss_dtype)
    loss32 = fused_linear_cross_entropy(hidden, weight, target)
    assert loss.dtype == loss_dtype and loss32.dtype == torch.float32
    assert loss == loss32.to(loss_dtype)  # one rounding of the float32 loss
    rows = cross_entropy(hidden.float() @ weight.float().t(), target, reduction="none", loss_dtype=loss_dtype)
    assert rows.dtype == loss_dtype and rows.shape == (6,)


def test_cross_entropy_all_ignored_strided_rows_and_empty(device):
    base = torch.randn(6, 80, device=device)
    logits = base[:, :50]  # rows of stride 80, read in place
    target = torch.full((6,), -100, device=device)
    leaf = logits.clone().requires_grad_()
    loss = cross_entropy(leaf, target)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(leaf.grad, torch.zeros_like(leaf))  # PyTorch: NaN
    target[:4] = torch.tensor([1, 7, 49, 0], device=device)
    torch.testing.assert_close(
        cross_entropy(logits, target), torch.nn.functional.cross_entropy(logits, target), rtol=1e-5, atol=1e-6
    )
    empty = torch.randn(0, 5, device=device, requires_grad=True)
    out = cross_entropy(empty, torch.zeros(0, dtype=torch.int64, device=device))
    out.backward()
    assert out.item() == 0.0 and empty.grad.shape == (0, 5)


@pytest.mark.parametrize("softcap", [30.0, 50.0])
def test_cross_entropy_float32_softcap_is_within_2x_of_pytorch(softcap, device):
    # the accurate tanh (core.kernel_math.tanh) keeps small capped logits as accurate as PyTorch's float32
    logits = torch.randn(16, 100).to(device)
    target = torch.randint(0, 100, (16,)).to(device)
    out_grad = torch.randn(16).double()
    kw = {"reduction": "none", "softcap": softcap}
    truth = _ce_run(
        cross_entropy_reference, *leaves(logits, dtype=torch.float64), target.cpu(), out_grad, **kw
    )
    same = _ce_run(cross_entropy_reference, *leaves(logits), target, out_grad.to(device), **kw)
    with expect_launches(*KERNELS, device=device):
        got = _ce_run(cross_entropy, *leaves(logits), target, out_grad.to(device), **kw)
    assert_error_rule("loss", got[0], same[0], truth[0], OUTPUT_FACTOR, torch.float32)
    assert_error_rule("dlogits", got[1], same[1], truth[1], GRAD_FACTOR, torch.float32)


@pytest.mark.parametrize("offset", [50.0, 1e4])
@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.1, "weighted": True}], ids=["plain", "smoothed"])
def test_cross_entropy_float32_logits_far_from_zero_are_within_2x_of_pytorch(offset, kw, device):
    """A common offset in every logit (a bias, an unnormalised head): the loss and the softmax come from the
    differences to the row's largest logit, as PyTorch's log_softmax. Computed from one float32 log-sum-exp
    they carried half an ulp of it: 4.9x PyTorch's loss error and 3.1x its gradient's at 50, 1e4x at 1e4."""
    logits = (torch.randn(16, 100) + offset).to(device)
    target = torch.randint(0, 100, (16,)).to(device)
    target[3] = -100
    out_grad = torch.randn(16).double()
    kw = dict(kw, reduction="none")
    weight = (torch.rand(100) + 0.5).to(device) if kw.pop("weighted", False) else None
    truth = _ce_run(cross_entropy_reference, *leaves(logits, dtype=torch.float64), target.cpu(), out_grad,
                    weight=None if weight is None else weight.double().cpu(), **kw)  # fmt: skip
    same = _ce_run(cross_entropy_reference, *leaves(logits), target, out_grad.to(device), weight=weight, **kw)
    with expect_launches(*KERNELS, device=device):
        got = _ce_run(cross_entropy, *leaves(logits), target, out_grad.to(device), weight=weight, **kw)
    assert_error_rule("loss", got[0], same[0], truth[0], OUTPUT_FACTOR, torch.float32)
    assert_error_rule("dlogits", got[1], same[1], truth[1], GRAD_FACTOR, torch.float32)


def test_cross_entropy_unchecked_bad_target_gives_nan_rows(monkeypatch, device):
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    logits = torch.randn(5, 30, device=device, requires_grad=True)
    target = torch.tensor([1, 30, 2, -7, 4], device=device)
    rows = cross_entropy(logits, target, reduction="none")
    rows.sum().backward()
    bad = torch.tensor([False, True, False, True, False])
    assert torch.isnan(rows[bad]).all() and torch.isfinite(rows[~bad]).all()
    assert torch.isnan(logits.grad[bad]).all() and torch.isfinite(logits.grad[~bad]).all()
    monkeypatch.setattr(runtime, "CHECK_INPUTS", True)
    with pytest.raises(ValueError, match="target holds 30"):
        cross_entropy(logits, target)


def test_cross_entropy_compile_fullgraph(device):
    logits = torch.randn(6, 40, device=device, requires_grad=True)
    target = torch.randint(0, 40, (6,), device=device)
    weight = torch.rand(40, device=device) + 0.5

    def loss_fn(x):
        loss, z = cross_entropy(x, target, weight=weight, lse_square_scale=1e-3, return_z_loss=True)
        return loss + 0 * z

    torch._dynamo.reset()
    with expect_launches(*KERNELS, REDUCE, device=device):
        torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(logits).backward()
    grad = logits.grad.clone()
    logits.grad = None
    loss_fn(logits).backward()
    torch.testing.assert_close(grad, logits.grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"logits": torch.ones(3, 4, 5)}, ValueError, r"logits must have 2 dims \[N, V\]"),
        ({"logits": torch.ones(3, 4, dtype=torch.float64)}, TypeError, "logits has dtype"),
        ({"target": torch.tensor([0, 1])}, ValueError, "target has 2 entries"),
        ({"weight": torch.ones(5)}, ValueError, "weight has 5 entries"),
        ({"weight": torch.ones(4, requires_grad=True)}, ValueError, "weight gets no gradient here"),
        ({"reduction": "batchmean"}, ValueError, "reduction is 'batchmean'"),
        ({"softcap": -1.0}, ValueError, "softcap must be > 0"),
        ({"target": torch.tensor([0, 4, 1])}, ValueError, "target holds 4"),
    ],
)
def test_cross_entropy_bad_input(kwargs, error, match):
    args = {"logits": torch.ones(3, 4), "target": torch.tensor([0, 1, 2]), **kwargs}
    with pytest.raises(error, match=match):
        cross_entropy(args.pop("logits"), args.pop("target"), **args)


def test_a_repeated_linear_call_skips_the_metadata_checks_not_the_values(device, monkeypatch):
    """A repeated fused_linear_cross_entropy call with the metadata of one checked before goes straight to
    the implementation (with grad inside the op's autograd node): the same loss and gradients as the checked
    call, as float64 says; the targets' values are still checked where they may be read."""
    from call_records import record_checks

    checked = record_checks(monkeypatch, device, ce, "_validate_linear")
    hidden = torch.randn(12, 32, device=device)
    weight = torch.randn(80, 32, device=device)
    target = torch.randint(0, 80, (12,), device=device)
    target[3] = -100
    results = []
    for _ in range(2):
        h, w = leaves(hidden, weight)
        loss = fused_linear_cross_entropy(h, w, target, label_smoothing=0.1, lse_square_scale=1e-3)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    with torch.no_grad():
        again = fused_linear_cross_entropy(hidden, weight, target, label_smoothing=0.1, lse_square_scale=1e-3)
    assert len(checked) == 1  # the first call: the others (without grad too: the same op) were kept
    for first, second in zip(*results, strict=True):
        assert torch.equal(first, second)
    assert torch.equal(again, results[0][0])
    h64, w64 = leaves(hidden, weight, dtype=torch.float64)
    truth = fused_linear_cross_entropy_reference(  # (leaves: on the CPU)
        h64, w64, target.cpu(), label_smoothing=0.1, lse_square_scale=1e-3
    )
    truth.backward()
    assert abs(results[1][0].item() - truth.item()) <= 1e-5 * max(1.0, abs(truth.item()))
    for got, truth in zip(results[1][1:], (h64.grad, w64.grad), strict=True):
        assert (got.cpu().double() - truth).abs().max() <= 1e-4 * max(1.0, truth.abs().max().item())
    if runtime.check_values(device):
        bad = target.clone()
        bad[0] = 80  # same metadata, a value out of range
        with pytest.raises(ValueError, match="target"):
            fused_linear_cross_entropy(hidden, weight, bad, label_smoothing=0.1, lse_square_scale=1e-3)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_repeated_one_chunk_call_equals_the_checked_one(device, monkeypatch, reduction, grad):
    """A repeated call whose rows make one chunk takes a lean one-chunk path (ce_launch.LinearCall: called for
    inference, its forward with grad and a reduced loss): the same loss, z-loss and gradients, bit for bit,
    as the first (checked) call, which ran the chunk loop; with grad one reduction launch (the gradients read
    the divisors it writes), not two."""
    ran = []
    for name in ("__call__", "forward"):
        real = getattr(ce_launch.LinearCall, name)
        monkeypatch.setattr(
            ce_launch.LinearCall, name, lambda *args, real=real, name=name: ran.append(name) or real(*args)
        )
    monkeypatch.setattr(ce, "_LINEAR_CALLS", CallCache())
    hidden = torch.randn(12, 32, device=device)
    weight = torch.randn(80, 32, device=device)
    target = torch.randint(0, 80, (12,), device=device)
    target[5] = -100
    options = dict(reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-3, return_z_loss=True)
    results = []
    for _ in range(2):
        h, w = leaves(hidden, weight) if grad else (hidden, weight)
        reduces = runtime.launch_count(ck.REDUCE.name)
        with torch.set_grad_enabled(grad):
            loss, z = fused_linear_cross_entropy(h, w, target, **options)
        reduces = runtime.launch_count(ck.REDUCE.name) - reduces
        if grad:
            loss.sum().backward()
        results.append((loss.detach(), z, *((h.grad, w.grad) if grad else ())))
    lean = "__call__" if not grad else "forward" if reduction != "none" else None
    assert ran == ([lean] if lean and runtime.triton_runs_on(device) else [])
    if runtime.triton_runs_on(device):
        assert reduces == (reduction != "none")
    for got, expected in zip(*results, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("case", ["weights_zero", "weights_cancel"])
def test_a_mean_over_class_weights_adding_up_to_zero_is_zero(case):
    """The docstring's rule for a "mean" whose divisor is 0 (loss 0, zero gradients) holds when the divisor
    is the kept rows' class weights: before, the kernel divided by 1 and returned the "sum" loss (found by
    the edge-value audit of 2026-12-07). PyTorch gives NaN or -inf there."""
    torch.manual_seed(0)
    logits = torch.randn(6, 40, requires_grad=True)
    target = torch.randint(0, 40, (6,))
    weight = torch.rand(40)
    options = {}
    if case == "weights_zero":  # every target's class weighs 0; the smoothing term still sees the others
        weight[target] = 0.0
        options["label_smoothing"] = 0.1
    else:  # two kept rows whose weights cancel
        weight[target[0]], weight[target[1]] = 1.0, -1.0
        target[2:] = -100
    loss = cross_entropy(logits, target, weight=weight, **options)
    loss.backward()
    assert loss.item() == 0.0 and not logits.grad.any()
    hidden = torch.randn(6, 16, requires_grad=True)
    head = (torch.randn(40, 16) * 0.3).requires_grad_()
    fused = fused_linear_cross_entropy(hidden, head, target, ce_weight=weight, **options)
    fused.backward()
    assert fused.item() == 0.0 and not hidden.grad.any() and not head.grad.any()
