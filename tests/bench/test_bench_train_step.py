"""``llm-speed bench train-step``: both variants train one tiny model to the same loss; MoE refused."""

import json

import pytest

pytest.importorskip("transformers")

from llm_speed.bench.train_step import llama_config  # noqa: E402
from llm_speed.cli import main  # noqa: E402
from llm_speed.perf.models import get_model  # noqa: E402

TINY = dict(model_type="llama", hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
            num_hidden_layers=2,
            intermediate_size=96, vocab_size=101, max_position_embeddings=64)  # fmt: skip


def test_both_variants_run_and_agree(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "train.json"
    argv = ["bench", "train-step", "--model", str(config), "--layers", "1", "--seq", "8", "--dtype", "fp32"]
    assert main([*argv, "--device", "cpu", "--warmup", "0", "--iterations", "1", "--output", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = {row["variant"]: row for row in payload["rows"]}
    assert set(rows) == {"transformers", "llm_speed"} and payload["settings"]["layers"] == 1
    assert rows["llm_speed"]["tokens_per_s"] > 0 and rows["llm_speed"]["tokens"] == 8
    assert rows["llm_speed"]["loss"] == pytest.approx(rows["transformers"]["loss"], rel=1e-4)


def test_moe_model_is_refused():
    with pytest.raises(ValueError, match="dense SwiGLU"):
        llama_config(get_model("mixtral-8x7b"), layers=1)
