"""``llm-speed bench train-step``: the variants train one tiny model from the same loss; Liger's row says why
it did not run; every patched family builds; a family that does not fit the model is refused before any
work."""

import csv
import dataclasses
import json

import pytest

pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]' (in .[dev] too)")

from llm_speed.bench import ops as ops_bench  # noqa: E402
from llm_speed.bench import report, train_step  # noqa: E402
from llm_speed.bench.timing import PeakMemory  # noqa: E402
from llm_speed.cli import main  # noqa: E402
from llm_speed.perf.models import get_model  # noqa: E402

TINY = dict(model_type="llama", hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
            num_hidden_layers=2,
            intermediate_size=96, vocab_size=101, max_position_embeddings=64)  # fmt: skip


def _argv(tmp_path, *flags):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    argv = ["bench", "train-step", "--model", str(config), "--layers", "1", "--seq", "8", "--dtype", "fp32"]
    return [*argv, "--device", "cpu", "--warmup", "0", "--iterations", "1", "--no-progress", *flags]


def test_every_variant_has_a_row_and_the_losses_agree(tmp_path, monkeypatch):
    monkeypatch.setattr(ops_bench, "liger_installed", lambda: False)
    out, table = tmp_path / "train.json", tmp_path / "train.csv"
    assert main(_argv(tmp_path, "--output", str(out), "--csv", str(table))) == 0
    payload = json.loads(out.read_text())
    assert payload["complete"] is True and payload["settings"]["layers"] == 1
    assert payload["environment"]["device_type"] == "cpu"
    rows = {row["impl"]: row for row in payload["results"]}
    assert list(rows) == ["transformers", "llm_speed", "liger"]
    ours, base, liger = rows["llm_speed"], rows["transformers"], rows["liger"]
    assert ours["tokens_per_s"] > 0 and ours["tokens"] == 8 and ours["flops"] > 0
    assert ours["loss"] == pytest.approx(base["loss"], rel=1e-4)
    assert (
        ours["loss_difference"] == pytest.approx(ours["loss"] - base["loss"]) and base["loss_difference"] == 0
    )
    assert ours["fastest_other"] == "transformers" and "whole training step" in ours["prediction_reason"]
    assert (
        not liger["available"] and liger["reason"] == ops_bench.LIGER_NOT_INSTALLED and liger["loss"] is None
    )
    with table.open() as handle:
        records = list(csv.DictReader(handle))
    assert [r["impl"] for r in records] == ["transformers", "llm_speed", "liger"]
    # no field that is null whatever the input: a whole step has no roofline floor nor prediction (the
    # reason says so), and every row computes in the run's dtype
    never = {"predicted_ms", "predicted_bound", "measured_over_predicted", "prediction_ms",
             "prediction_bound", "prediction_error", "prediction_calibrated"}  # fmt: skip
    assert all(never.isdisjoint(row) and row["dtype"] == "fp32" for row in payload["results"])
    assert never.isdisjoint(records[0]) and records[0]["dtype"] == "fp32"


def test_peak_beyond_the_weights_and_gradients(tmp_path, monkeypatch, capsys):
    """Peak memory is measured on CUDA only: a stand-in peak shows what each row subtracts (every parameter
    and its gradient, 2 x 4 bytes each in float32) and the table's column."""
    monkeypatch.setattr(ops_bench, "liger_installed", lambda: False)
    peak = 10 * 2**20

    def fake_peak(fn, device=None):
        fn()
        return PeakMemory(peak_bytes=peak, above_baseline_bytes=peak)

    monkeypatch.setattr(report, "peak_memory", fake_peak)
    assert main(_argv(tmp_path, "--impl", "transformers", "llm_speed", "--json")) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    for row in rows:
        parameters = row["bytes_moved"] / (5 * 4)  # bytes_moved: 5 x parameters x 4 bytes (module docstring)
        assert row["peak_memory_bytes"] == peak
        assert row["peak_beyond_parameters_bytes"] == peak - 2 * 4 * parameters > 0
    assert main(_argv(tmp_path, "--impl", "transformers")) == 0
    assert "peak beyond weights+grads" in capsys.readouterr().out


def test_liger_on_a_cpu_is_not_run_with_the_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ops_bench, "liger_installed", lambda: True)
    built = []
    monkeypatch.setattr(train_step, "run_train_step", lambda *a, **k: built.append(1))
    # Liger alone: refused before the model is built (exit 2, as bench ops), with the reason
    assert main(_argv(tmp_path, "--impl", "liger", "--json")) == 2
    captured = capsys.readouterr()
    assert "--impl: none of the implementations asked for can run here" in captured.err
    assert "need a CUDA device" in captured.err and captured.out == "" and not built
    monkeypatch.undo()
    monkeypatch.setattr(ops_bench, "liger_installed", lambda: True)
    # beside a variant that runs: Liger's row says why it did not
    assert main(_argv(tmp_path, "--impl", "transformers", "liger", "--json")) == 0
    rows = {row["impl"]: row for row in json.loads(capsys.readouterr().out)["results"]}
    assert rows["transformers"]["available"]
    assert not rows["liger"]["available"] and "need a CUDA device" in rows["liger"]["reason"]


def test_a_family_that_does_not_fit_the_model_is_refused_before_any_work(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(train_step, "run_train_step", lambda *a, **k: ran.append(1))
    argv = ["bench", "train-step", "--model", "mixtral-8x7b", "--family", "llama", "--layers", "1"]
    assert main([*argv, "--device", "cpu"]) == 2
    assert "is an MoE model; family 'llama' needs a dense one" in capsys.readouterr().err and not ran
    with pytest.raises(ValueError, match="needs an MoE one"):
        train_step.family_config(get_model("llama-3-8b"), "qwen3_moe", layers=1)
    with pytest.raises(ValueError, match="MLA"):
        train_step.family_config(get_model("mixtral-8x7b"), "deepseek_v3", layers=1)


def test_a_config_json_that_does_not_fit_the_family_is_named_by_its_path(tmp_path, capsys):
    """The refusal names the --model given and --family, not the config.json's folder (``model 'out'``)."""
    folder = tmp_path / "out"
    folder.mkdir()
    path = folder / "tiny_config.json"
    path.write_text(json.dumps(TINY))
    argv = ["bench", "train-step", "--model", str(path), "--family", "mixtral", "--device", "cpu"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert f"--family: --model {path} is a dense model; family 'mixtral' needs an MoE one" in error
    assert "'out'" not in error


def test_every_patched_family_builds_from_the_zoo():
    from llm_speed.bench.options import TRAIN_STEP_FAMILIES
    from llm_speed.integrations.transformers import SUPPORTED

    assert tuple(train_step.FAMILIES) == TRAIN_STEP_FAMILIES == SUPPORTED
    dense, moe, mla = get_model("llama-3-8b"), get_model("mixtral-8x7b"), get_model("deepseek-v3")
    assert train_step.default_family(dense, "llama-3-8b") == "llama"
    assert train_step.default_family(moe, "mixtral-8x7b") == "mixtral"
    assert train_step.default_family(mla, "deepseek-v3") == "deepseek_v3"
    for family in TRAIN_STEP_FAMILIES:
        model = mla if family == "deepseek_v3" else moe if family in train_step.MOE_FAMILIES else dense
        config = train_step.family_config(model, family, layers=2)
        assert config.model_type == family and config.num_hidden_layers == 2
        assert config.hidden_size == model.hidden_size and config.vocab_size == model.vocab_size


def test_an_moe_family_of_a_config_json(tmp_path, monkeypatch):
    # a Mixtral config.json's sizes in Qwen3-MoE's layers (--family): the routed experts through llm_speed.moe
    monkeypatch.setattr(ops_bench, "liger_installed", lambda: False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)))
    assert train_step.default_family(train_step.resolve_model(str(path)), str(path)) == "mixtral"
    out = tmp_path / "train.json"
    argv = ["bench", "train-step", "--model", str(path), "--family", "qwen3_moe", "--layers", "1"]
    argv += ["--seq", "8"]
    argv += ["--dtype", "fp32", "--device", "cpu", "--warmup", "0", "--iterations", "1", "--no-progress",
             "--impl", "transformers", "llm_speed", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["settings"]["family"] == "qwen3_moe"
    rows = {row["impl"]: row for row in payload["results"]}
    assert "(qwen3_moe)" in rows["llm_speed"]["case"] and rows["llm_speed"]["tokens_per_s"] > 0
    assert rows["llm_speed"]["loss"] == pytest.approx(rows["transformers"]["loss"], rel=1e-4)


def test_too_many_layers_and_a_bad_output_are_refused(tmp_path, capsys):
    assert main(_argv(tmp_path, "--layers", "3")) == 2
    assert "layers: " in capsys.readouterr().err
    assert main(_argv(tmp_path, "--output", "/nonexistent-llm-speed/dir/t.json")) == 2
    assert "--output: folder" in capsys.readouterr().err


def test_a_model_that_cannot_fit_the_host_is_refused_with_the_layers_that_would(monkeypatch, capsys):
    from llm_speed.bench import cpu_load
    from llm_speed.perf.models import param_count

    settings = train_step.TrainStepSettings(
        model="llama-3-8b", family="llama", layers=None, batch=1, seq=16, dtype="bf16",
        impls=("transformers",), warmup=0, iterations=1, min_time_s=0.0, device="cuda",
    )  # fmt: skip
    # the weights kept in host memory, counted as param_count counts them (the first N layers too)
    assert train_step.host_memory_floor(settings) == 2 * param_count("llama-3-8b").total
    two = param_count(dataclasses.replace(get_model("llama-3-8b"), num_layers=2)).total
    assert train_step.host_memory_floor(settings, layers=2) == 2 * two
    on_cpu = dataclasses.replace(settings, device="cpu")
    # on a CPU the variant's model and its gradients live there too
    assert train_step.host_memory_floor(on_cpu) == 3 * train_step.host_memory_floor(settings)
    assert train_step.memory_refusal(settings, 2 * param_count("llama-3-8b").total) is None
    reason = train_step.memory_refusal(settings, 2 * two)
    assert reason.startswith("model: llama-3-8b with 32 layers needs at least 16.1 GB of host memory")
    assert reason.endswith("give --layers 2 or fewer")
    ran = []
    monkeypatch.setattr(cpu_load, "available_memory", lambda: 10**6)
    monkeypatch.setattr(train_step, "run_train_step", lambda *a, **k: ran.append(1))
    assert main(["bench", "train-step", "--model", "llama-3-8b", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "llm-speed bench train-step: error: --model: llama-3-8b with 32 layers needs at least" in err
    assert "even one layer does not fit" in err and not ran


def test_the_first_layers_of_a_dense_first_moe_model():
    # DeepSeek-V3's first 3 layers are dense: --layers 2 keeps a dense model (a ModelConfig with 2 layers of
    # which 3 dense cannot exist: the costs raised after the model was built), --layers 5 two MoE layers
    from llm_speed.perf.mfu import training_flops_per_token
    from llm_speed.perf.models import param_count

    config = get_model("deepseek-v3")
    two = train_step.first_layers(config, 2)
    assert two.num_layers == 2 and not two.is_moe and two.uses_mla
    five = train_step.first_layers(config, 5)
    assert (five.num_dense_layers, five.num_moe_layers) == (3, 2)
    assert train_step.first_layers(config, None) == config
    per_dense = param_count(train_step.first_layers(config, 3)).total - param_count(two).total
    assert per_dense == param_count(two).total - param_count(train_step.first_layers(config, 1)).total > 0
    assert param_count(five).total > param_count(train_step.first_layers(config, 3)).total + 2 * per_dense
    settings = train_step.TrainStepSettings(
        model="deepseek-v3", family="deepseek_v3", layers=2, batch=1, seq=16, dtype="bf16",
        impls=("transformers",), warmup=0, iterations=1, min_time_s=0.0, device="cuda",
    )  # fmt: skip
    flops, _ = train_step._costs(config, settings, param_count(two).total)
    assert flops == training_flops_per_token(two, 16, "causal") * 16 > 0
    assert train_step.host_memory_floor(settings) == 2 * param_count(two).total
