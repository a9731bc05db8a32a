"""cuda_llm_ops keeps the old memory formulas literally; llm_speed's functions of the same names fix them."""

import pytest

import cuda_llm_ops
import llm_speed


def test_old_memory_hierarchy_numbers():
    mem = cuda_llm_ops.analyze_memory_hierarchy()
    assert set(mem) == {"shared_memory", "l2_cache", "hbm"}
    assert mem["hbm"]["bandwidth_tb_s"] == pytest.approx(1.5)
    assert mem["l2_cache"]["bandwidth_tb_s"] == pytest.approx(1.5)
    # 1 KB at 19 TB/s and at 1.5 TB/s, as the old project printed them.
    assert f"{mem['shared_memory']['latency_ns']:6.2f}" == "  0.05"
    assert f"{mem['hbm']['latency_ns']:6.2f}" == "  0.68"
    assert "latency_ns" not in llm_speed.analyze_memory_hierarchy()["hbm"]


def test_old_attention_vram_numbers():
    # 128K tokens, 32 heads, head_dim 128, fp16: the old "34.4 GB" attention matrix (one head's).
    old = cuda_llm_ops.calculate_attention_vram(128 * 1024, 32, 128)
    assert round(old["attention_matrix"], 1) == 34.4
    assert f"{old['total']:10.2f}" == "     38.65"
    assert f"{cuda_llm_ops.calculate_attention_vram(512, 32, 128)['total']:10.2f}" == "      0.02"
    assert f"{cuda_llm_ops.calculate_attention_vram(4096, 32, 128)['total']:10.2f}" == "      0.17"
    new = llm_speed.calculate_attention_vram(128 * 1024, 32, 128)
    assert new["attention_matrix"] == pytest.approx(32 * old["attention_matrix"])
    assert new["qkv"] == old["qkv"] and new["output"] == old["output"]


def test_old_functions_raise_the_old_errors():
    with pytest.raises(cuda_llm_ops.CudaLlmOpsError, match="seq_len"):
        cuda_llm_ops.calculate_attention_vram(-1, 32, 128)
    with pytest.raises(RuntimeError, match="dtype"):
        cuda_llm_ops.estimate_attention_memory(2, 16, 8192, 64, dtype="fp5")
