"""The cost model of collectives: one all-reduce (ring, tree or NVLink SHARP) among GPUs over a link."""

from __future__ import annotations

import math

from llm_speed.core.args import non_negative_number, positive_int
from llm_speed.perf.prediction.names import Prediction
from llm_speed.perf.prediction.terms import Terms, no_more


def predict_all_reduce(spec, consts, impl, params, problem) -> tuple[Terms, float, float, list[str]]:
    """One all-reduce of ``size_bytes`` among ``num_gpus`` over ``link``: ring (2(n-1)/n of the buffer
    through each GPU's link), tree (2x, plus 2 ceil(log2 n) latencies), NVLink SHARP (nvls: the switch
    reduces what every GPU pushes and multicasts the result, so each GPU moves D(1 + 1/n) through its link:
    the reduce-scatter reads D out of each GPU and returns D/n, the all-gather pushes D/n and multicasts
    D back), or "auto" (the faster of ring and nvls, as NCCL's tuner picks)."""
    from llm_speed.perf.distributed import link_bandwidth

    size = non_negative_number("size_bytes", problem.pop("size_bytes"))
    n = positive_int("num_gpus", problem.pop("num_gpus"))
    link = problem.pop("link", "nvlink")
    no_more(problem, "all_reduce")
    line = link_bandwidth(spec, link)
    latency = float(params.get("latency_s", 0.0))
    ring_rate = line * float(params["ring_efficiency"])
    nvls_ok = (
        link == "nvlink"
        and spec.architecture in ("Hopper", "Blackwell")
        and not spec.id.startswith(("h100-pcie", "h100-nvl"))
    )

    def ring() -> float:
        return latency + 2 * (n - 1) / n * size / ring_rate

    def nvls() -> float:
        return latency + size * (1 + 1 / n) / (line * float(params["nvls_efficiency"]))

    notes = []
    if n == 1:
        seconds = 0.0
    elif impl == "ring":
        seconds = ring()
    elif impl == "tree":
        seconds = 2 * math.ceil(math.log2(n)) * latency + 2 * size / ring_rate
    elif impl == "nvls":
        if not nvls_ok:
            raise ValueError(
                "NVLink SHARP (nvls, which implementation 'vendor' means for all_reduce) needs "
                f"third-generation NVSwitch (H100/H200/B200 SXM systems) and link='nvlink'; {spec.id} over "
                f"{link} has none: use ring, tree or auto"
            )
        seconds = nvls()
    else:
        seconds = min(ring(), nvls()) if nvls_ok else ring()
        notes.append("auto: " + ("nvls" if nvls_ok and nvls() < ring() else "ring"))
    busy = max(0.0, seconds - (latency if n > 1 else 0.0))
    terms = Terms(
        compute_s=0.0,
        memory_s=busy,
        latency_s=latency if n > 1 else 0.0,
        dram_bytes=size,
        l2_bytes=0.0,
        bandwidth=size / busy if busy else 0.0,
        eta=0.0,
        notes=tuple(notes),
    )
    return terms, 0.0, size, notes


def all_reduce_figures(prediction: Prediction) -> dict[str, float]:
    """nccl-tests' figures of an all-reduce prediction: algbw = size / time, busbw = algbw x 2(n-1)/n."""
    size = prediction.problem["size_bytes"]
    n = prediction.problem["num_gpus"]
    algbw = size / prediction.seconds if prediction.seconds else math.inf
    return {"algbw_bytes_per_s": algbw, "busbw_bytes_per_s": algbw * 2 * (n - 1) / n}
