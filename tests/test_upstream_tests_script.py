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
