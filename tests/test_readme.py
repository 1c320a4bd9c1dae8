"""The README's and the documentation's claims match the code.

The README is a front page; the detail lives in ``docs/``. Both are checked here: supported families,
the test command CI runs, the compatibility table, the headline results table, the README's Python
example (run), every page and link of the site, and the release canary.
"""

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

import fastgen
from benchmarks import report
from fastgen.models.decoder_only import PROMPT_SHARING_FAMILIES
from fastgen.models.encoder_decoder import CROSS_ATTENTION_FAMILIES
from fastgen.models.family_checks import cross_attention_call_problem
from fastgen.optimizer.fairseq.patches import FAIRSEQ_VERSIONS
from fastgen.optimizer.registry import OPT_IN_FEATURES
from fastgen.optimizer.transformers.contract import NEWEST_TESTED
from fastgen.optimizer.transformers.patches import HF_VERSIONS
from tests.harness import tiny_hf_model

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
PAGES = {p.relative_to(DOCS).as_posix(): p.read_text() for p in sorted(DOCS.rglob("*.md"))}


def _families(text: str, kind: str) -> list[set[str]]:
    found = re.findall(rf"<!-- families:{kind} -->(.*?)<!-- /families -->", text)
    return [{name.strip() for name in group.split(",")} for group in found]


def _claimed(kind: str) -> set[str]:
    found = _families(README, kind)
    assert found, f"README has no {kind} family list"
    return found[0]


def test_readme_families_match_the_support_tables():
    assert _claimed("encoder-decoder") == set(CROSS_ATTENTION_FAMILIES)
    assert _claimed("decoder-only") == set(PROMPT_SHARING_FAMILIES)


def test_the_docs_family_lists_are_the_readmes():
    """Each family list in the docs says what the README's says (the README's are tested against the code)."""
    kinds = set(re.findall(r"<!-- families:([\w-]+) -->", README))
    assert kinds >= {"encoder-decoder", "decoder-only", "speculative", "continuous", "continuous-decoder-only"}
    for page, text in PAGES.items():
        for kind in set(re.findall(r"<!-- families:([\w-]+) -->", text)):
            assert kind in kinds, f"{page}: family list {kind} is not in the README"
            assert all(group == _claimed(kind) for group in _families(text, kind)), (page, kind)


def test_ci_runs_the_readme_test_command():
    command = "bash scripts/test.sh"
    assert f"```bash\n   {command}\n   ```" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci.splitlines()


def test_the_test_command_builds_the_docs_strictly_and_smoke_tests_the_wheel():
    matrix = (ROOT / "scripts" / "test.sh").read_text()
    assert "mkdocs build --strict" in matrix and "scripts/smoke_wheel.sh" in matrix
    smoke = (ROOT / "scripts" / "smoke_wheel.sh").read_text()
    for step in ("-m build", "-m fastgen.info", 'fastgen-generate" --help', 'fastgen-generate-hf" --help'):
        assert step in smoke, step


def test_the_release_canary_is_documented_and_runs_the_fast_path_tests():
    assert "```bash\nbash scripts/canary.sh\n```" in PAGES["compatibility.md"]
    assert '-m "fast_path and not slow"' in (ROOT / "scripts" / "canary.sh").read_text()
    matrix = (ROOT / "scripts" / "test.sh").read_text()
    assert '-m "fast_path and not slow"' in matrix and "transformers==5.15.1" in matrix


def _compat_table(text: str) -> str:
    match = re.search(r"<!-- compat-table -->(.*?)<!-- /compat-table -->", text, re.S)
    assert match, "no compatibility table"
    return match.group(1)


def test_the_compatibility_table_matches_the_code_and_ci():
    table = _compat_table(README)
    assert table.strip() == report.compat_table().strip()  # the docs page renders the same generator
    assert "<!-- generated:compat-table -->" in PAGES["compatibility.md"]
    assert report.versions_line() in README
    rows = {line.split("|")[1].strip(): line for line in table.strip().splitlines()[2:]}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {re.split(r"[<>=]", d)[0]: d for d in project["dependencies"]}
    assert f"≥ {project['requires-python'].removeprefix('>=')}" in rows["Python"]
    assert f"≥ {deps['torch'].removeprefix('torch>=')}" in rows["torch"]
    assert f"`{HF_VERSIONS}`" in rows["Transformers"] and NEWEST_TESTED in rows["Transformers"]
    matrix = (ROOT / "scripts" / "test.sh").read_text()
    oldest = re.search(r"transformers==([\d.]+)", matrix).group(1)
    previous = re.search(r"FASTGEN_PREVIOUS_TRANSFORMERS:-([\d.]+)", matrix).group(1)
    assert oldest in rows["Transformers"] and previous in rows["Transformers"]
    assert f"`{FAIRSEQ_VERSIONS}`" in rows["fairseq"]


def test_the_readme_results_table_is_generated_from_the_committed_results():
    block = README[README.index(report.BEGIN) + len(report.BEGIN) : README.index(report.END)]
    assert block.strip() == report.table().strip()
    assert "CPU kind" in block


def test_the_docs_say_which_features_are_opt_in():
    """The feature overview's "default" column is what ``enable()`` does."""
    rows = re.findall(r"^\| `(\w+)` \| (on|opt-in) \|", PAGES["how-it-works/index.md"], re.M)
    assert {name for name, _ in rows} == set(fastgen.known_features())
    for name, default in rows:
        assert (default == "opt-in") == (name in OPT_IN_FEATURES), name


def test_every_generated_block_of_the_docs_renders():
    for page, text in PAGES.items():
        if "<!-- generated:" in text:
            rendered = report.fill_generated(text)
            assert "<!-- generated:" not in rendered, page


def test_the_gpu_page_renders_the_h200_results():
    """docs/benchmarks/gpu.md's tables come from the committed ``*-cuda*`` JSON, H200 rows included."""
    page = PAGES["benchmarks/gpu.md"]
    for name in ("results-gpu", "max-batch", "step-profile", "continuous-gpu", "ops-gpu"):
        assert f"<!-- generated:{name} -->" in page, name
    assert "<!-- generated:speculative:speculative-cuda.json -->" in page
    sequences_only = next(line for line in report.max_batch().splitlines() if "sequences only" in line)
    assert "NVIDIA H200" in sequences_only and "| 16 (32 fails) | 80 (96 fails) |" in sequences_only
    assert "**12%**" in report.step_profile() and "| 457 |" in report.step_profile()
    assert "warm **1.30×**" in report.continuous_gpu()
    ops = report.ops_gpu()
    assert all(op in ops for op in ("n-gram blocking", "cross-attention over shared K/V", "beam top-k step"))
    assert "NVIDIA H200" in report.tables_by_machine(gpu_only=True)
    assert "AMD EPYC" not in report.tables_by_machine(gpu_only=True)


def test_every_page_is_in_the_nav_and_every_readme_link_exists():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES:
        assert f": {page}\n" in nav, f"{page} is not in mkdocs.yml's nav"
    for target in re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#]*)", README):
        assert (ROOT / target).is_file(), target


def _whisper_options(kind: str) -> set[str]:
    found = re.findall(rf"<!-- whisper:{kind} -->(.*?)<!-- /whisper -->", PAGES["how-it-works/dedup.md"], re.S)
    assert found, f"the dedup page names no Whisper options that are {kind}"
    return {name.strip(" `") for group in found for name in group.split(",")}


def test_docs_whisper_options_match_the_code():
    """The generate options the docs say Whisper shares / runs upstream are what the dedup check decides."""
    whisper = tiny_hf_model("whisper")
    for option in _whisper_options("shared"):
        assert cross_attention_call_problem(whisper, GenerationConfig(**{option: True})) is None, option
    for option in _whisper_options("upstream"):
        assert cross_attention_call_problem(whisper, GenerationConfig(**{option: True})) is not None, option


def test_the_readme_python_example_runs(tmp_path):
    """The quick start's tiny model, then the README's example as written: it asserts equality itself."""
    example = re.search(r"## In Python\n\n```python\n(.*?)```", README, re.S).group(1)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), "tiny-model"],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
    )
    run = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ran" in run.stdout and "dedup" in run.stdout, run.stdout


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="fast_gemm needs oneDNN")
def test_the_documented_fast_gemm_switch_is_valid():
    """The CPU-modes page's one switch names only known features and turns on fast_gemm."""
    call = re.search(r"fastgen\.enable\(features=(\[.*?\])\)", PAGES["guides/cpu-modes.md"]).group(1)
    env_line = re.search(r"FASTGEN_FEATURES=([\w,]+)", PAGES["guides/cpu-modes.md"]).group(1)
    features = ast.literal_eval(call)
    assert features == env_line.split(",") and "fast_gemm" in features
    assert set(fastgen.known_features()) - OPT_IN_FEATURES <= set(features)


def _readme_command(name: str) -> list[str]:
    block = re.search(r"## Command line\n\n```bash\n(.*?)```", README, re.S).group(1)
    line = next(line for line in block.splitlines() if line.startswith(name + " "))
    return shlex.split(line.split("#")[0])[1:]


def test_the_readme_command_lines_parse():
    """The two CLI lines of the README use options the commands have (fairseq's parser for fastgen-generate)."""
    from fastgen.cli import generate_hf

    args = generate_hf.build_parser().parse_args(_readme_command("fastgen-generate-hf"))
    assert (args.num_beams, args.max_new_tokens) == (4, 64)
    if importlib.util.find_spec("fairseq") is not None:
        from fastgen.cli import generate

        args = generate.parse_args(_readme_command("fastgen-generate"))
        assert (args.beam, args.batch_size, args.results_path) == (4, 64, "out/")
