"""The README's claims match the code: supported families and the test command CI runs."""

import re
from pathlib import Path

from fastgen.models.decoder_only import PROMPT_SHARING_FAMILIES
from fastgen.models.encoder_decoder import CROSS_ATTENTION_FAMILIES

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
