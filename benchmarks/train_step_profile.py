"""Which CUDA kernels a training step spends its time in, per variant (2026-11-25 H100: `bench train-step
--model llama-3-8b --layers 2 --seq 2048` took 84.6 ms with llm-speed's patch against 28.2 ms unpatched).

    python benchmarks/train_step_profile.py [--variants transformers llm_speed] [--top 25]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["transformers", "llm_speed"])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    import transformers

    from llm_speed.bench import train_step
    from llm_speed.perf.models import resolve_model

    device = torch.device("cuda")
    config = resolve_model(args.model)
    family = train_step.default_family(config, args.model)
    hf_config = train_step.family_config(config, family, args.layers)
    torch.manual_seed(0)
    with torch.device(device):
        base = transformers.AutoModelForCausalLM.from_config(hf_config).to(torch.bfloat16)
    ids = torch.randint(0, hf_config.vocab_size, (1, args.seq), device=device)
    for variant in args.variants:
        model = copy.deepcopy(base)
        train_step._patch(variant, model, family)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)

        def step(model=model, optimizer=optimizer):
            optimizer.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        print(f"=== {variant}: {(time.perf_counter() - began) / 5 * 1e3:.1f} ms a step", flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        events = [e for e in profile.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        events.sort(key=lambda e: e.device_time_total, reverse=True)
        total = sum(e.device_time_total for e in events) / 2
        print(f"CUDA kernel time a step: {total / 1e3:.1f} ms")
        for e in events[: args.top]:
            print(f"{e.device_time_total / 2e3:9.2f} ms {e.count // 2:5d}x  {e.key[:110]}")
        del model, optimizer
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
