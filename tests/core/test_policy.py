"""The launch policy (``llm_speed.core.policy``): a choice without a GPU proof is off as shipped and is a
candidate; ``use_policy`` and ``LLM_SPEED_POLICY`` select one; plans are keyed on it; ``doctor`` lists every
choice with its proof or "unproven"."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from llm_speed.attention import launcher
from llm_speed.core import launch, policy
from llm_speed.core.policy import CANDIDATES, PROOFS, SHIPPED, LaunchPolicy, current_policy, use_policy

FIELDS = [field.name for field in dataclasses.fields(LaunchPolicy)]
# A choice's value with it off: what a candidate turns on is everything else.
OFF = {"forward_overlap_head_dims": (), "forward_tma_kv_head_dims": (), "backward_tma_head_dims": (),
       "backward_dq_kernel_tiers": (), "backward_tma_dq_add": False, "lpt_min_rows": None,
       "rows32": False, "uniform_bounds": False, "decode_append_in_attention": False,
       "fp8_weights_gpu_cast": False, "gluon_forward_head_dims": (),
       "gluon_backward_head_dims": (), "gluon_gemm_fp8": False, "gluon_gemm_int8": False,
       "gluon_fp8_forward_head_dims": ()}  # fmt: skip


def test_every_choice_has_a_proof_entry_and_an_off_value():
    assert set(PROOFS) == set(FIELDS) == set(OFF)


@pytest.mark.parametrize("field", FIELDS)
def test_a_choice_without_proof_is_off_as_shipped_and_a_candidate(field):
    proof = PROOFS[field]
    if proof is None:
        assert getattr(SHIPPED, field) == OFF[field], f"{field} is on as shipped without a GPU proof"
        candidate = policy.candidate_of(field)
        assert candidate is not None, f"{field}: unproven and no candidate measures it"
        assert getattr(candidate.policy, field) != OFF[field] and candidate.target["op"]
    elif getattr(SHIPPED, field) != OFF[field]:
        assert proof.ratio >= 1.0, f"{field} ships on although measured slower ({proof.ratio:.2f}x)"
        assert os.path.exists(proof.results), proof.results


def test_every_candidate_differs_from_shipped_in_unproven_choices_only():
    """... or is a retest: a proven choice timed again because its alternative changed after the proof."""
    assert set(policy.RETESTS) <= set(CANDIDATES)
    for name, candidate in CANDIDATES.items():
        assert candidate.name == name
        changed = [f for f in FIELDS if getattr(candidate.policy, f) != getattr(SHIPPED, f)]
        proven = [f for f in changed if PROOFS[f] is not None]
        assert changed and (not proven or (name in policy.RETESTS and len(changed) == 1)), (name, changed)


def test_doctor_names_the_retest_beside_the_proof():
    lines = {field: text for field, _, text in policy.proof_lines()}
    assert lines["backward_dq_kernel_tiers"].endswith(
        "; to be retimed by backward-atomic-dq (its alternative changed since)")
    assert "retimed" not in lines["lpt_min_rows"]


def test_use_policy_selects_and_restores():
    start = current_policy()  # SHIPPED, or the candidate LLM_SPEED_POLICY names
    with use_policy("forward-overlap") as chosen:
        assert current_policy() is chosen == CANDIDATES["forward-overlap"].policy
        with use_policy(rows32=True):
            assert current_policy().rows32 and current_policy().forward_overlap_head_dims == (128,)
        assert current_policy() is chosen
    assert current_policy() is start
    with use_policy("shipped"):
        assert current_policy() is SHIPPED


def test_bad_choices_are_refused_naming_what_is_accepted():
    accepted = "not a candidate; accepted: shipped, backward-atomic-dq, forward-overlap"
    with pytest.raises(ValueError, match=accepted):
        with use_policy("fast"):
            pass
    with pytest.raises(TypeError, match="unknown launch choice.*rows_32"):
        with use_policy(rows_32=True):
            pass
    with pytest.raises(TypeError, match="rows32 must be a bool"):
        LaunchPolicy(rows32=1)
    with pytest.raises(TypeError, match="forward_overlap_head_dims must be a tuple"):
        LaunchPolicy(forward_overlap_head_dims=[128])
    with pytest.raises(TypeError, match="lpt_min_rows"):
        LaunchPolicy(lpt_min_rows=-1)


def test_the_environment_selects_a_starting_policy():
    code = "from llm_speed.core.policy import current_policy as c; print(c().forward_overlap_head_dims)"
    env = dict(os.environ, LLM_SPEED_POLICY="forward-overlap")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "(128,)", done.stderr[-2000:]
    env["LLM_SPEED_POLICY"] = "nonsense"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode and "LLM_SPEED_POLICY='nonsense'" in done.stderr


def test_plans_are_keyed_on_the_policy():
    """A plan made under one policy is not reused under another (the overlap and TMA switches of the
    d = 128 forward, on the CUDA path simulated with the H100's hardware)."""
    from llm_speed import flash_attention

    q, k, v = (torch.randn(1, 2, 256, 128, dtype=torch.float16) for _ in range(3))
    made = []
    launch.clear_plans()
    try:
        with launch.simulated_gpu():
            for name in ("shipped", "forward-overlap-tma-kv", "shipped"):
                with use_policy(name):
                    before = launch.Plan._first

                    def first(plan, _before=before, **per_call):
                        made.append(plan)
                        return _before(plan, **per_call)

                    launch.Plan._first = first
                    try:
                        flash_attention(q, k, v)
                    finally:
                        launch.Plan._first = before
    finally:
        launch.clear_plans()
    # the third call reuses the first's plan (no first launch: not recorded)
    assert [plan.fixed["OVERLAP"] for plan in made] == [False, True]
    assert [bool(plan.descriptors) for plan in made] == [False, True]


@pytest.mark.skipif(bool(os.environ.get("LLM_SPEED_POLICY")), reason="a candidate policy is in force")
def test_doctor_names_every_unproven_choice(capsys, monkeypatch):
    from llm_speed import cli, doctor

    monkeypatch.setattr(doctor, "dispatch", lambda device: {})  # the ops' probes: tested elsewhere
    assert cli.main(["doctor", "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["launch_policy"]
    assert report["policy"] == "shipped"
    rows = {row["choice"]: row for row in report["choices"]}
    assert set(FIELDS) <= set(rows)
    unproven = [field for field in FIELDS if PROOFS[field] is None]
    assert "forward_overlap_head_dims" in unproven
    for field in unproven:
        assert rows[field]["proof"].startswith("unproven") and rows[field]["shipped"] == repr(OFF[field])
    assert "4c378d4" in rows["lpt_min_rows"]["proof"]
    assert rows["backward base-2 LSE"]["proof"].startswith("not a switch")
    assert cli.main(["doctor", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "forward_overlap_head_dims" in text and "unproven" in text


def test_the_ab_script_plans_a_candidate_on_the_cpu(capsys):
    """``benchmarks/attention_ab.py --check``: the candidate's target planned under both policies, the
    switch it turns on seen in the plans; an unknown name refused naming the candidates."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_ab.py"
    spec = importlib.util.spec_from_file_location("attention_ab", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check", "--candidates", "forward-overlap"]) == 0
    assert "OVERLAP: False -> True" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        module.main(["--check", "--candidates", "faster"])
    assert "accepted: backward-atomic-dq, forward-overlap" in capsys.readouterr().err


def test_calls_already_checked_are_keyed_on_the_policy():
    """A kept call's key holds the policy's number: equal policies share it, another policy gets its own."""
    q, k, v = (torch.randn(1, 2, 64, 64, dtype=torch.float16) for _ in range(3))
    keys = []
    for name in ("shipped", "forward-overlap", "shipped"):
        with use_policy(name):
            keys.append(launcher.dense_call_key(q, k, v, False, None, False))
    with use_policy(dataclasses.replace(CANDIDATES["forward-overlap"].policy)):  # an equal policy
        keys.append(launcher.dense_call_key(q, k, v, False, None, False))
    assert keys[0] == keys[2] and keys[1] == keys[3] and keys[0] != keys[1]
