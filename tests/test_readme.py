"""The README's claims match the code: supported families and the test command CI runs."""

import re
from pathlib import Path

from transformers import GenerationConfig

from fastgen.models.decoder_only import PROMPT_SHARING_FAMILIES
from fastgen.models.encoder_decoder import CROSS_ATTENTION_FAMILIES
from fastgen.models.family_checks import cross_attention_call_problem
from tests.harness import tiny_hf_model

README = (Path(__file__).parent.parent / "README.md").read_text()


def _claimed(kind: str) -> set[str]:
    match = re.search(rf"<!-- families:{kind} -->(.*?)<!-- /families -->", README)
    assert match, f"README has no {kind} family list"
    return {name.strip() for name in match.group(1).split(",")}


def test_readme_families_match_the_support_tables():
    assert _claimed("encoder-decoder") == set(CROSS_ATTENTION_FAMILIES)
    assert _claimed("decoder-only") == set(PROMPT_SHARING_FAMILIES)


def test_ci_runs_the_readme_test_command():
    command = "bash scripts/test.sh"
    assert f"```bash\n   {command}\n   ```" in README
    ci = (Path(__file__).parent.parent / ".ci" / "run").read_text()
    assert command in ci.splitlines()


def test_the_release_canary_is_documented_and_runs_the_fast_path_tests():
    root = Path(__file__).parent.parent
    assert "```bash\nbash scripts/canary.sh\n```" in README
    assert '-m "fast_path and not slow"' in (root / "scripts" / "canary.sh").read_text()
    matrix = (root / "scripts" / "test.sh").read_text()
    assert '-m "fast_path and not slow"' in matrix and "transformers==5.15.1" in matrix


def _whisper_options(kind: str) -> set[str]:
    found = re.findall(rf"<!-- whisper:{kind} -->(.*?)<!-- /whisper -->", README, re.S)
    assert found, f"README names no Whisper options that are {kind}"
    return {name.strip(" `") for group in found for name in group.split(",")}


def test_readme_whisper_options_match_the_code():
    """The generate options the README says Whisper shares / runs upstream are what the dedup check decides."""
    whisper = tiny_hf_model("whisper")
    for option in _whisper_options("shared"):
        assert cross_attention_call_problem(whisper, GenerationConfig(**{option: True})) is None, option
    for option in _whisper_options("upstream"):
        assert cross_attention_call_problem(whisper, GenerationConfig(**{option: True})) is not None, option
