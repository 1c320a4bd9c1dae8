"""scripts/upstream_tests.py: junit parsing, the plain/fastgen comparison and the plain-cache choice.

The suites themselves need the network and most of an hour, so they stay out of CI; this checks the
logic that decides what the report says, on two hand-written junit files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "upstream_junit"
GPT2 = "tests.models.gpt2.test_modeling_gpt2.GPT2ModelTest::"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("upstream_tests", ROOT / "scripts" / "upstream_tests.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_parse_junit_outcomes_and_messages(script):
    plain = script.parse_junit(FIXTURES / "plain.xml")
    assert {test: result.outcome for test, result in plain.items()} == {
        GPT2 + "test_greedy": "passed",
        GPT2 + "test_beam_dict_outputs": "passed",
        GPT2 + "test_needs_hub": "failed",
        GPT2 + "test_gpu_only": "skipped",
        GPT2 + "test_known_bug": "skipped",  # xfail is reported as skipped
        "tests.test_sequence_generator.TestSequenceGenerator::test_only_plain": "passed",
    }
    assert plain[GPT2 + "test_needs_hub"].message == "OSError: We couldn't connect to 'https://huggingface.co'"
    assert script.count_outcomes(plain) == {"passed": 3, "failed": 1, "skipped": 2, "error": 0}


def test_a_test_reported_twice_keeps_its_worse_outcome(script):
    fastgen = script.parse_junit(FIXTURES / "fastgen.xml")
    assert fastgen[GPT2 + "test_beam_dict_outputs"] == script.TestResult(
        "error", 'failed on teardown with "RuntimeError: leaked patch"'
    )
    assert script.count_outcomes(fastgen) == {"passed": 1, "failed": 2, "skipped": 2, "error": 1}


def test_empty_message_attribute_falls_back_to_the_E_lines(script, tmp_path):
    xml = tmp_path / "one.xml"
    xml.write_text(
        '<testsuite><testcase classname="a.B" name="test_c"><failure message="">trace\n'
        "&gt;  x()\nE   AssertionError: 1 != 2\nE   more\n</failure></testcase></testsuite>"
    )
    assert script.parse_junit(xml)["a.B::test_c"].message == "E   AssertionError: 1 != 2\nE   more"


def test_compare_lists_only_changed_outcomes(script):
    comparison = script.compare(
        script.parse_junit(FIXTURES / "plain.xml"), script.parse_junit(FIXTURES / "fastgen.xml")
    )
    assert [(d["test"], d["plain"], d["fastgen"]) for d in comparison.differing] == [
        (GPT2 + "test_beam_dict_outputs", "passed", "error"),
        (GPT2 + "test_known_bug", "skipped", "failed"),
    ]
    # test_needs_hub fails on both sides: not a difference.
    assert comparison.differing[1]["message"] == "XPASS(strict) known upstream bug"
    assert comparison.only_in_plain == ["tests.test_sequence_generator.TestSequenceGenerator::test_only_plain"]
    assert comparison.only_in_fastgen == ["tests.test_sequence_generator.TestSequenceGenerator::test_only_fastgen"]
    report = script.format_comparison("demo", comparison)
    assert "plain:   3 passed, 1 failed, 2 skipped, 0 error" in report
    assert "differing outcomes: 2" in report
    assert "      XPASS(strict) known upstream bug" in report


def test_compare_mode_writes_json_and_exit_status(script, tmp_path):
    out = tmp_path / "summary.json"
    status = script.main(["--compare", str(FIXTURES / "plain.xml"), str(FIXTURES / "fastgen.xml"), "--json", str(out)])
    assert status == 1
    summary = json.loads(out.read_text())["suites"]["compare"]
    assert summary["fastgen"] == {"passed": 1, "failed": 2, "skipped": 2, "error": 1}
    assert len(summary["differing"]) == 2
    same = script.main(["--compare", str(FIXTURES / "plain.xml"), str(FIXTURES / "plain.xml")])
    assert same == 0


def test_missing_xml_reads_as_one_error(script, tmp_path):
    results = script.read_results(tmp_path / "absent.xml")
    assert [r.outcome for r in results.values()] == ["error"]


def test_plain_cache_prefers_the_same_selection_then_the_whole_file(script, tmp_path):
    suite = script.Suite("fairseq", tmp_path, ("tests/test_x.py",), "", "not slow", {})
    args = argparse.Namespace(cache_dir=tmp_path, plain_cache=True, k="beam")
    exact = script.xml_path(tmp_path, "plain", suite, "tests/test_x.py", "beam")
    full = script.xml_path(tmp_path, "plain", suite, "tests/test_x.py", None)
    assert exact != full
    assert script.plain_xml_for(suite, "tests/test_x.py", args) == (exact, False)  # nothing cached: run it
    full.parent.mkdir(parents=True)
    full.write_text("<testsuite/>")
    assert script.plain_xml_for(suite, "tests/test_x.py", args) == (full, True)  # compare the subset
    exact.write_text("<testsuite/>")
    assert script.plain_xml_for(suite, "tests/test_x.py", args) == (exact, False)
    args.plain_cache = False
    assert script.plain_xml_for(suite, "tests/test_x.py", args) == (exact, False)


def test_files_need_a_single_suite(script):
    with pytest.raises(SystemExit):
        script.parse_args(["--files", "tests/test_x.py"])
    assert script.parse_args(["--suite", "fairseq", "--files", "tests/test_x.py"]).files == ["tests/test_x.py"]


def test_transformers_files_cover_every_family_fastgen_patches(script):
    """The families come from fastgen's own tables, not a list kept by hand beside them."""
    from fastgen.models.decoder_only import PROMPT_SHARING_FAMILIES
    from fastgen.models.encoder_decoder import CROSS_ATTENTION_FAMILIES

    families = set(CROSS_ATTENTION_FAMILIES) | set(PROMPT_SHARING_FAMILIES)
    assert set(script.patched_families()) == families and len(families) == 17
    files = script.transformers_files()
    model_files = [f for f in files if f.startswith("tests/models/")]
    assert len(model_files) == len(set(model_files)) == 17
    assert "tests/models/gemma3/test_modeling_gemma3.py" in model_files  # model_type gemma3_text
    assert "tests/models/m2m_100/test_modeling_m2m_100.py" in model_files
    assert files[len(model_files) :] == script.GENERATION_FILES
    with pytest.raises(ValueError):
        script.family_test_file("fairseq.models.transformer.TransformerModel")


def _report(ran=(), fell_back=(), degraded=(), counts=None):
    import fastgen

    return fastgen.Report(
        ran={feature: ["how"] for feature in ran},
        fell_back=list(fell_back),
        degraded=list(degraded),
        counts=counts or {},
    )


def test_tally_counts_each_feature_and_reason_once_per_call_and_adds_up(script):
    tally = script.CallTally()
    tally.add(_report(ran=("dedup", "beam", "gemm")))
    # A reason noted twice in one call counts once; two reasons of one feature count apart.
    tally.add(_report(ran=("gemm",), fell_back=[("beam", "output_attentions=True")] * 2), raised=True)
    tally.add(_report(fell_back=[("beam", "constraints"), ("dedup", "model type 'x'")]))
    tally.add(_report(ran=("speculative",), counts={"speculative": {"proposed": 10, "accepted": 7}}))
    tally.add(_report(ran=("dedup",), degraded=[("dedup", "eager attention")]))
    assert (tally.calls, tally.raised, tally.no_fast_path) == (5, 1, 1)
    assert tally.ran == {"dedup": 2, "beam": 1, "gemm": 2, "speculative": 1}
    assert tally.fell_back == {"beam": {"output_attentions=True": 1, "constraints": 1}, "dedup": {"model type 'x'": 1}}
    assert tally.degraded == {"dedup": {"eager attention": 1}}
    total = script.CallTally.from_json(json.loads(json.dumps(tally.to_json())))
    assert total == tally
    total.problems = ["a: pending"]
    total.merge(tally)
    assert total.calls == 10 and total.ran["dedup"] == 4 and total.fell_back["beam"]["constraints"] == 2
    assert total.counted == {"speculative": {"proposed": 20, "accepted": 14}} and total.problems == ["a: pending"]
    lines = script.format_tally(tally)
    assert (
        lines[0]
        == "  5 generate calls (1 raised); fast path ran: beam 1, dedup 2, gemm 2, speculative 1; no feature ran: 1"
    )
    assert "  fell back beam: 2" in lines and "          1  constraints" in lines
    assert script.read_tally(Path("/nonexistent/calls.json")) is None


def test_missing_family_files_are_reported_not_run(script, tmp_path, capsys):
    suite = script.Suite("transformers", tmp_path, ("tests/models/new/test_modeling_new.py",), "", "not x", {})
    args = argparse.Namespace(cache_dir=tmp_path, plain_cache=False, run="both", k=None, jobs=1)
    run = script.run_suite(suite, args)
    assert run.missing_files == ["tests/models/new/test_modeling_new.py"] and run.calls == {}
    assert run.comparison.plain == dict.fromkeys(script.OUTCOMES, 0)
    assert "tests/models/new/test_modeling_new.py is missing in" in capsys.readouterr().out


TINY_SUITE = """
import torch
import transformers


def test_generate():
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
    )
    model = transformers.BartForConditionalGeneration(config).eval()
    ids = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 11, 12, 2]])
    model.generate(ids, num_beams=3, no_repeat_ngram_size=2, max_new_tokens=4)
    model.generate(ids, num_beams=2, max_new_tokens=4, output_attentions=True, return_dict_in_generate=True)
    model.generate(ids[:1], max_new_tokens=3)
"""


def test_fastgen_run_tallies_every_generate_call_per_file(script, tmp_path):
    """A tiny suite through the script: plain and fastgen agree, and the fastgen run's plugin says which
    calls took which fast path and which fell back, with the reason."""
    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    (tree / "tests/test_tiny.py").write_text(TINY_SUITE)
    targets = script.GENERATE_TARGETS["transformers"]
    suite = script.Suite("transformers", tree, ("tests/test_tiny.py",), "", "not nothing", {}, targets)
    args = argparse.Namespace(
        cache_dir=tmp_path / "cache", plain_cache=False, run="both", k=None, jobs=1, timeout=300, file_timeout=600
    )
    run = script.run_suite(suite, args)
    assert run.comparison.plain == run.comparison.fastgen == {"passed": 1, "failed": 0, "skipped": 0, "error": 0}
    tally = run.calls["tests/test_tiny.py"]
    assert (tally.calls, tally.raised) == (3, 0), script.format_tally(tally)
    assert tally.ran["dedup"] == 2 and tally.ran["beam"] == 1 and tally.ran["ngram"] == 1
    assert tally.fell_back == {"beam": {"output_attentions=True": 1}}
    assert tally.problems == []
    assert run.to_json()["generate_calls"]["total"]["calls"] == 3
    assert "  fell back beam: 1" in script.format_calls(run)


@pytest.mark.parametrize(
    "imports",
    [
        "from transformers.testing_utils import (\n    _TEXT_MODEL_TESTER_DEFAULTS,\n    require_torch,\n)\n",
        "from transformers.testing_utils import _TEXT_MODEL_TESTER_DEFAULTS\n",  # multimodal_tester.py (gemma3)
    ],
)
def test_removed_tester_defaults_fall_back_to_the_tagged_dict(script, imports):
    code = f"{imports}\nfrom .test_configuration_common import ConfigTester\n\nx = _TEXT_MODEL_TESTER_DEFAULTS\n"
    shimmed = script.shim_tester_defaults(code, '_TEXT_MODEL_TESTER_DEFAULTS = {\n    "batch_size": 13,\n}\n')
    namespace = {}
    exec(shimmed.replace("from .test_configuration_common import ConfigTester\n", ""), namespace)
    assert namespace["x"] == {"batch_size": 13}  # this transformers has no such name: the fallback is used
    assert script.shim_tester_defaults(shimmed, "unused") is None  # applied once
    assert script.shim_tester_defaults("import os\n", "unused") is None
