"""Compile every MoE kernel for Hopper (sm_90) exactly as its plans launch it, with the Triton on the path
(run in a subprocess without TRITON_INTERPRET by test_moe_compile_sm90.py); prints one JSON line per
kernel."""

import importlib
import json
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

grouped = importlib.import_module("llm_speed.moe.grouped_gemm")
fused = importlib.import_module("llm_speed.moe.fused_moe")
routing = importlib.import_module("llm_speed.moe.routing")

POINTEE = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}
CPU = torch.device("cpu")


def compile_sm90(plan, per_call):
    fn = plan.kernel.fn
    names = fn.arg_names
    constexpr_params = {names[i] for i in fn.constexprs}
    signature, constexprs, divisible = {}, {}, []
    for name in names:
        value = plan.fixed[name] if name in plan.fixed else per_call[name]
        if name in constexpr_params:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + POINTEE[value.dtype]
            divisible.append(name)  # fresh allocations are 16-byte aligned
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            if value == 1:  # Triton specialises an integer argument equal to 1 as a constant
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                if value % 16 == 0:
                    divisible.append(name)
    index = {name: i for i, name in enumerate(names)}
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(index[k],): v for k, v in constexprs.items()},
        attrs={(index[n],): [["tt.divisibility", 16]] for n in divisible},
    )
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": plan.num_warps, "num_stages": plan.num_stages},
    )
    ptx = compiled.asm["ptx"]
    return {
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma": ptx.count("mma.sync"),
        "shared": compiled.metadata.shared,
    }


def t(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype)


def cases():
    """(name, plan, per-call tensors) of each kernel at a Qwen3-30B-A3B layer's shapes on an H100 (the
    interpreter is off in this process: the compiled configurations)."""
    tokens, experts, top_k, hidden, inter = 8192, 128, 8, 2048, 768
    copies = tokens * top_k
    i32 = torch.int32
    bf16 = (torch.bfloat16,) * 3
    for dtype, dtypes in ((torch.bfloat16, bf16), (torch.float32, (torch.float32,) * 3)):
        name = "fp32" if dtype == torch.float32 else "bf16"
        w1 = t(experts, 2 * inter, hidden, dtype=dtype)
        s_e, s_n, s_k = w1.stride()
        plan = grouped._grouped_plan(
            copies,
            inter,
            hidden,
            experts,
            (hidden, 1),
            (s_e, s_k, s_n),
            (inter, 1),
            dtypes,
            top_k,
            True,
            False,
            CPU,
        )
        yield (
            f"grouped gate/up + SwiGLU {name}",
            plan,
            dict(
                a_ptr=t(tokens, hidden, dtype=dtype),
                b_ptr=w1,
                out_ptr=t(copies, inter, dtype=dtype),
                offsets_ptr=t(experts, dtype=i32),
                order_ptr=t(copies, dtype=i32),
            ),
        )
    w2 = t(experts, hidden, inter)
    s_e, s_n, s_k = w2.stride()
    plan = grouped._grouped_plan(
        copies, hidden, inter, experts, (inter, 1), (s_e, s_k, s_n), (hidden, 1), bf16, 0, False, False, CPU
    )
    yield (
        "grouped down bf16",
        plan,
        dict(
            a_ptr=t(copies, inter),
            b_ptr=w2,
            out_ptr=t(copies, hidden),
            offsets_ptr=t(experts, dtype=i32),
            order_ptr=t(experts, dtype=i32),
        ),
    )
    plan = grouped._wgrad_plan(
        copies,
        hidden,
        inter,
        experts,
        (hidden, 1),
        (inter, 1),
        w2.stride(),
        (*bf16, torch.float32),
        (top_k, 0),
        True,
        False,
        CPU,
    )
    yield (
        "wgrad W_down (gather, scale) bf16",
        plan,
        dict(
            a_ptr=t(tokens, hidden),
            b_ptr=t(copies, inter),
            out_ptr=w2,
            offsets_ptr=t(experts, dtype=i32),
            order_ptr=t(copies, dtype=i32),
            scale_ptr=t(copies, dtype=torch.float32),
        ),
    )
    w1 = t(experts, 2 * inter, hidden)
    strides = (hidden, hidden, w1.stride(), w2.stride())
    plan = fused._backward_plan(
        copies,
        hidden,
        inter,
        experts,
        top_k,
        strides,
        (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32),
        False,
        CPU,
    )
    yield (
        "fused_moe backward bf16",
        plan,
        dict(
            x_ptr=t(tokens, hidden),
            dout_ptr=t(tokens, hidden),
            w1_ptr=w1,
            w2_ptr=w2,
            topw_ptr=t(tokens, top_k, dtype=torch.float32),
            order_ptr=t(copies, dtype=i32),
            offsets_ptr=t(experts, dtype=i32),
            dh_ptr=t(copies, 2 * inter),
            act_ptr=t(copies, inter),
            dwp_ptr=t(copies, plan.fixed["stride_dwp"], dtype=torch.float32),
        ),
    )
    plan = fused._combine_plan(
        tokens,
        hidden,
        top_k,
        hidden,
        True,
        False,
        12,
        (torch.bfloat16, None, torch.bfloat16, torch.float32, torch.float32),
        CPU,
    )
    yield (
        "combine (rows, partials) bf16",
        plan,
        dict(
            y_ptr=t(copies, hidden),
            inverse_ptr=t(copies, dtype=i32),
            weights_ptr=t(copies, dtype=i32),
            out_ptr=t(tokens, hidden),
            partials_ptr=t(copies, 12, dtype=torch.float32),
            dw_ptr=t(tokens, top_k, dtype=torch.float32),
        ),
    )
    plan = routing._route_plan(
        tokens, 256, 256, 8, False, True, True, 8, 4, (torch.bfloat16, torch.float32), CPU
    )
    yield (
        "route (sigmoid, bias, groups)",
        plan,
        dict(
            logits_ptr=t(tokens, 256),
            bias_ptr=t(256, dtype=torch.float32),
            weights_ptr=t(tokens, 8, dtype=torch.float32),
            ids_ptr=t(tokens, 8, dtype=i32),
            scale=2.5,
        ),
    )
    plan = routing._route_backward_plan(
        tokens, 256, (256, 8), 8, True, True, (torch.bfloat16, torch.float32, i32), CPU
    )
    yield (
        "route backward",
        plan,
        dict(
            logits_ptr=t(tokens, 256),
            dweights_ptr=t(tokens, 8, dtype=torch.float32),
            ids_ptr=t(tokens, 8, dtype=i32),
            dlogits_ptr=t(tokens, 256),
            scale=2.5,
        ),
    )
    count, place = routing._sort_plans(copies, experts, torch.int64, CPU)
    ids, counts = t(copies, dtype=torch.int64), t(count.grid[0], place.fixed["BLOCK_E"], dtype=i32)
    yield "sort count", count, dict(ids_ptr=ids, counts_ptr=counts)
    yield (
        "sort place",
        place,
        dict(
            ids_ptr=ids,
            counts_ptr=counts,
            order_ptr=t(copies, dtype=i32),
            inverse_ptr=t(copies, dtype=i32),
            offsets_ptr=t(experts, dtype=i32),
        ),
    )


if __name__ == "__main__":
    only = sys.argv[1:]
    for name, plan, per_call in cases():
        if only and not any(word in name for word in only):
            continue
        start = time.time()
        result = compile_sm90(plan, per_call)
        result.update(
            name=name,
            seconds=round(time.time() - start, 2),
            warps=plan.num_warps,
            stages=plan.num_stages,
            fixed={k: v for k, v in plan.fixed.items() if k.startswith("BLOCK")},
        )
        print(json.dumps(result), flush=True)
