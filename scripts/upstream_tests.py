#!/usr/bin/env python
"""Run Transformers' and fairseq's own test suites plain and with fastgen, and compare test by test.

fastgen promises identical results, so every test whose outcome changes when fastgen is imported first
is a bug until shown otherwise. This script makes that check reproducible:

1. assemble the upstream tests (never committed) in a cache directory outside the repository:
   Transformers' model tests of every family fastgen patches (read from fastgen's own family tables; a
   family the tagged tree lacks is reported, not run) and ``tests/generation`` from a tagged git tree
   (a URL or a local git directory), with the installed release's common test files (``tests/*.py``,
   ``pyproject.toml``) from its PyPI sdist on top; fairseq's ``tests/`` at its release tag;
2. install the extra test dependencies into the running interpreter's environment if missing;
3. run each test file twice in its own pytest process: plain (``FASTGEN_DISABLE=1``) and with
   ``python -m pytest -p fastgen -p upstream_tests`` (fastgen imported before anything else, and this
   file as a plugin that tallies what fastgen did in every ``generate`` call), each with a junit XML;
4. compare the outcomes test by test, print the counts and the tests that differ, and per file how many
   ``generate`` calls took each fast path and how many fell back, with the reasons; write a JSON summary.

The plain run does not depend on fastgen's code: ``--plain-cache`` reuses its XML from an earlier run.

    .venv/bin/python scripts/upstream_tests.py --json upstream.json                 # everything (~1 h on 2 cores)
    .venv/bin/python scripts/upstream_tests.py --plain-cache --json upstream.json   # after a fastgen change
    .venv/bin/python scripts/upstream_tests.py --suite fairseq                      # fairseq only (~1 min)
    .venv/bin/python scripts/upstream_tests.py --compare plain.xml fastgen.xml      # two junit files
    .venv/bin/python scripts/upstream_tests.py --transformers-git /path/to/transformers.git \
        --fairseq-git /path/to/fairseq.git --json upstream.json                    # local git dirs, no clone
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextvars
import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import types
import xml.etree.ElementTree as ET
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = Path(os.environ.get("FASTGEN_UPSTREAM_CACHE", Path.home() / ".cache/fastgen/upstream-tests"))

TRANSFORMERS_GIT = "https://github.com/huggingface/transformers"
# The newest tagged Transformers tree that could be fetched where this script was written; with network
# access pass --transformers-git https://github.com/huggingface/transformers --ref v<installed>.
TRANSFORMERS_REF = "v5.15.0"
FAIRSEQ_GIT = "https://github.com/facebookresearch/fairseq"
FAIRSEQ_REF = "v0.12.3"

GENERATION_FILES = (
    "tests/generation/test_utils.py",
    "tests/generation/test_logits_process.py",
    "tests/generation/test_configuration_utils.py",
)


def patched_families() -> dict[str, str]:
    """``model_type`` -> attention class of every Transformers family fastgen patches, read from fastgen's
    own tables (the README's list is guarded against the same two), so this script cannot drift from them."""
    from fastgen.models.decoder_only import PROMPT_SHARING_FAMILIES
    from fastgen.models.encoder_decoder import CROSS_ATTENTION_FAMILIES

    return {**CROSS_ATTENTION_FAMILIES, **PROMPT_SHARING_FAMILIES}


def family_test_file(attention_class: str) -> str:
    """Upstream names a family's test file after its modeling module, which ``model_type`` need not match
    (``gemma3_text`` lives in ``models/gemma3``): ``transformers.models.D.modeling_M.Class`` ->
    ``tests/models/D/test_modeling_M.py``."""
    package, models, directory, module, _ = attention_class.split(".")
    if (package, models) != ("transformers", "models") or not module.startswith("modeling_"):
        raise ValueError(f"not a Transformers model class path: {attention_class}")
    return f"tests/models/{directory}/test_{module}.py"


def transformers_files() -> tuple[str, ...]:
    """One model test file per patched family (families sharing a file count once), then the generation tests."""
    family_files = dict.fromkeys(family_test_file(cls) for cls in patched_families().values())
    return (*family_files, *GENERATION_FILES)


# Multi-process parallelism tests need several devices; the -k exclusions are slow on CPU and never
# call generate (eager-vs-sdpa in half precision, gradient checkpointing, old dtype argument).
TRANSFORMERS_MARKERS = "not is_fsdp_test and not is_tensor_parallel_test and not is_expert_parallel_test"
TRANSFORMERS_DESELECT = (
    "not (eager_matches_sdpa_inference and (fp16 or bf16)) and not training_gradient_checkpointing"
    " and not bc_torch_dtype"
)

FAIRSEQ_FILES = (
    "tests/test_sequence_generator.py",
    "tests/test_multihead_attention.py",
    "tests/test_sequence_scorer.py",
    "tests/test_export.py",
    "tests/test_noising.py",
    "tests/test_inference_dropout.py",
    "tests/test_transformer.py",
    "tests/test_constraints.py",
    "tests/test_lstm_jitable.py",
    "tests/test_lm_context_window.py",
    # train-then-generate runs of fairseq's command-line tools, in process (~10 min on 2 cores)
    "tests/test_binaries.py",
)
# xFormers is not installed; the laser models need a tokenizer download; the other test_binaries
# classes (masked LMs, optimizers, activation checkpointing) never generate; test_max_positions is
# flaky upstream (its data comes from the unseeded ``random`` module; without fastgen it failed in
# 1 of 3 runs here, with fastgen 2 of 4).
FAIRSEQ_DESELECT = (
    "not test_xformers_single_forward_parity and not laser and not TestMaskedLanguageModel"
    " and not TestOptimizers and not TestActivationCheckpointing and not test_max_positions"
)

# import name -> pip requirement; what the upstream test suites import beyond fastgen's dev deps.
TEST_DEPS = {
    "parameterized": "parameterized",
    "timeout_decorator": "timeout-decorator",
    "pytest_timeout": "pytest-timeout",
    "xdist": "pytest-xdist",
    "pytest_env": "pytest-env",
    "sentencepiece": "sentencepiece",
    "google.protobuf": "protobuf",
    "httpx": "httpx",
}

OUTCOMES = ("passed", "failed", "skipped", "error")
MESSAGE_LINES = 4


# --------------------------------------------------------------------------------------------------
# junit XML parsing and comparison (unit-tested in tests/test_upstream_tests_script.py)


@dataclasses.dataclass(frozen=True)
class TestResult:
    outcome: str  # one of OUTCOMES
    message: str = ""


def _severity(outcome: str) -> int:
    return {"passed": 0, "skipped": 1, "failed": 2, "error": 3}[outcome]


def _first_lines(text: str, n: int = MESSAGE_LINES) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[:n])


def _case_result(case: ET.Element) -> TestResult:
    for tag, outcome in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
        element = case.find(tag)
        if element is not None:
            message = element.get("message") or ""
            if outcome != "skipped":
                # pytest's message attribute is the exception line; the body holds the "E   " lines.
                detail = [line for line in (element.text or "").splitlines() if line.startswith("E ")]
                message = message if message.strip() else "\n".join(detail)
            return TestResult(outcome, _first_lines(message))
    return TestResult("passed")


def parse_junit(source: str | Path | io.IOBase) -> dict[str, TestResult]:
    """Test id (``classname::name``) -> result. A test reported twice (a teardown error after a
    failure) keeps its worse outcome."""
    results: dict[str, TestResult] = {}
    for case in ET.parse(source).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        result = _case_result(case)
        previous = results.get(test_id)
        if previous is None or _severity(result.outcome) > _severity(previous.outcome):
            results[test_id] = result
    return results


def count_outcomes(results: dict[str, TestResult]) -> dict[str, int]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for result in results.values():
        counts[result.outcome] += 1
    return counts


@dataclasses.dataclass
class Comparison:
    plain: dict[str, int]
    fastgen: dict[str, int]
    differing: list[dict[str, str]]
    only_in_plain: list[str]
    only_in_fastgen: list[str]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def compare(plain: dict[str, TestResult], fastgen: dict[str, TestResult]) -> Comparison:
    """Tests whose outcome differs; the message shown is the failing side's (fastgen's if both fail)."""
    differing = []
    for test_id in sorted(plain.keys() & fastgen.keys()):
        before, after = plain[test_id], fastgen[test_id]
        if before.outcome != after.outcome:
            failing = after if _severity(after.outcome) >= _severity(before.outcome) else before
            differing.append(
                {"test": test_id, "plain": before.outcome, "fastgen": after.outcome, "message": failing.message}
            )
    return Comparison(
        plain=count_outcomes(plain),
        fastgen=count_outcomes(fastgen),
        differing=differing,
        only_in_plain=sorted(plain.keys() - fastgen.keys()),
        only_in_fastgen=sorted(fastgen.keys() - plain.keys()),
    )


def format_comparison(name: str, comparison: Comparison) -> str:
    def counts(c: dict[str, int]) -> str:
        return ", ".join(f"{c[o]} {o}" for o in OUTCOMES)

    lines = [f"== {name}", f"plain:   {counts(comparison.plain)}", f"fastgen: {counts(comparison.fastgen)}"]
    lines.append(f"differing outcomes: {len(comparison.differing)}")
    for diff in comparison.differing:
        lines.append(f"  {diff['test']}: plain {diff['plain']}, fastgen {diff['fastgen']}")
        lines.extend(f"      {line}" for line in diff["message"].splitlines())
    for side in ("only_in_plain", "only_in_fastgen"):
        missing = getattr(comparison, side)
        if missing:
            lines.append(f"{side.replace('_', ' ')}: {len(missing)}")
            lines.extend(f"  {test_id}" for test_id in missing)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# what each generate call did: a pytest plugin for the fastgen run, and the tallies it writes
#
# A green comparison alone cannot tell a patched run from one that fell back everywhere. The fastgen
# run therefore loads this file as a pytest plugin too (``-p upstream_tests``, with ``scripts/`` on
# PYTHONPATH): it wraps the frameworks' generate entry points so that every outermost call runs inside
# its own ``fastgen.report()``, tallies what the report says, and writes the tally as JSON when pytest
# ends. The script then adds the tallies up per file and per suite.

CALLS_JSON_ENV = "FASTGEN_UPSTREAM_CALLS_JSON"
CALLS_TARGETS_ENV = "FASTGEN_UPSTREAM_CALLS_TARGETS"
PLUGIN = Path(__file__).stem

# "module:Owner.attr" entry points per suite; nested calls (fairseq's generate -> _generate, an
# assistant model's generate inside assisted decoding) count once, as the outermost call.
GENERATE_TARGETS = {
    "transformers": ("transformers.generation.utils:GenerationMixin.generate",),
    "fairseq": tuple(
        f"fairseq.sequence_generator:SequenceGenerator.{name}" for name in ("generate", "forward", "_generate")
    ),
}


@dataclasses.dataclass
class CallTally:
    """How many generate calls took each fastgen feature's fast path, fell back (per reason), or took a
    slower exact path (degraded, per reason); ``no_fast_path``: calls in which no feature ran at all."""

    calls: int = 0
    raised: int = 0
    no_fast_path: int = 0
    ran: dict[str, int] = dataclasses.field(default_factory=dict)
    fell_back: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    degraded: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    counted: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)  # entry points not counted, patches pending

    def add(self, report, raised: bool = False) -> None:
        """Tally one call's ``fastgen.Report``: each feature and each distinct reason counts once per call."""
        self.calls += 1
        self.raised += raised
        self.no_fast_path += not report.ran
        for feature in report.ran:
            self.ran[feature] = self.ran.get(feature, 0) + 1
        for field, events in (("fell_back", report.fell_back), ("degraded", report.degraded)):
            for feature, reason in dict.fromkeys(events):
                _add_count(getattr(self, field).setdefault(feature, {}), reason, 1)
        for feature, counts in report.counts.items():
            for name, value in counts.items():
                _add_count(self.counted.setdefault(feature, {}), name, value)

    def merge(self, other: CallTally) -> None:
        self.calls += other.calls
        self.raised += other.raised
        self.no_fast_path += other.no_fast_path
        for feature, n in other.ran.items():
            _add_count(self.ran, feature, n)
        for field in ("fell_back", "degraded", "counted"):
            for feature, counts in getattr(other, field).items():
                mine = getattr(self, field).setdefault(feature, {})
                for key, n in counts.items():
                    _add_count(mine, key, n)
        self.problems += [problem for problem in other.problems if problem not in self.problems]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CallTally:
        return cls(**{field.name: data[field.name] for field in dataclasses.fields(cls) if field.name in data})


def _add_count(counts: dict[str, int], key: str, n: int) -> None:
    counts[key] = counts.get(key, 0) + n


def format_tally(tally: CallTally, indent: str = "  ") -> list[str]:
    """A few lines: calls, fast paths taken, fallbacks and slower paths with their reasons."""
    ran = ", ".join(f"{feature} {n}" for feature, n in sorted(tally.ran.items())) or "none"
    lines = [
        f"{indent}{tally.calls} generate calls ({tally.raised} raised); fast path ran: {ran}; "
        f"no feature ran: {tally.no_fast_path}"
    ]
    for field, label in (("fell_back", "fell back"), ("degraded", "slower path")):
        for feature, reasons in sorted(getattr(tally, field).items()):
            lines.append(f"{indent}{label} {feature}: {sum(reasons.values())}")
            ranked = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))
            lines.extend(f"{indent}    {n:5d}  {reason}" for reason, n in ranked)
    return lines


def read_tally(path: Path) -> CallTally | None:
    """None when the fastgen run wrote no tally (pytest crashed or was killed)."""
    try:
        return CallTally.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _counting_wrapper(func, tally: CallTally, lock):
    """``func`` wrapped so that each outermost call runs in its own ``fastgen.report()`` and is tallied.

    Like fastgen's own dispatcher (see ``fastgen.optimizer.registry._make_dispatcher``) the body reads
    closure variables only and the function gets the upstream original's globals, so that TorchScript,
    which compiles the source found through ``__wrapped__``, scripts fairseq's generator unchanged. The
    wrapped function's ``__dict__`` is not copied: a fastgen marker on it would make a patch applied
    later see this wrapper as fastgen's own.
    """
    import fastgen

    _fastgen_count_inside = contextvars.ContextVar("fastgen_count_inside", default=False)
    _fastgen_count_func, _fastgen_count_report, _fastgen_count_tally = func, fastgen.report, tally
    _fastgen_count_lock = lock

    def counted(*args, **kwargs):
        if _fastgen_count_inside.get():
            return _fastgen_count_func(*args, **kwargs)
        token, report, raised = _fastgen_count_inside.set(True), None, True
        try:
            with _fastgen_count_report() as report:
                result = _fastgen_count_func(*args, **kwargs)
            raised = False
            return result
        finally:
            _fastgen_count_inside.reset(token)
            if report is not None:
                with _fastgen_count_lock:
                    _fastgen_count_tally.add(report, raised)

    globals_ = getattr(inspect.unwrap(func), "__globals__", None)
    if globals_ is not None:
        counted = types.FunctionType(counted.__code__, globals_, counted.__name__, None, counted.__closure__)
    return functools.update_wrapper(counted, func, updated=())


def install_counters(targets: list[str], tally: CallTally) -> list[str]:
    """Wrap each ``module:Owner.attr`` target (importing its module, so fastgen patches it first).
    Returns the targets that could not be wrapped, with why."""
    lock, problems = threading.Lock(), []
    for target in targets:
        module_name, _, attr_path = target.partition(":")
        owner_path, _, name = attr_path.rpartition(".")
        try:
            owner = importlib.import_module(module_name)
            for part in owner_path.split("."):
                owner = getattr(owner, part)
            func = owner.__dict__[name]
        except (ImportError, AttributeError, KeyError) as exc:
            problems.append(f"{target}: not counted ({type(exc).__name__}: {exc})")
            continue
        setattr(owner, name, _counting_wrapper(func, tally, lock))
    return problems


def stuck_patches() -> list[str]:
    """fastgen patches still pending although their module has been imported (they never ran)."""
    import fastgen

    return [
        f"{row.target}: {row.state}"
        for row in fastgen.status()
        if row.state.startswith("pending") and row.target.partition(":")[0] in sys.modules
    ]


_plugin_tally: tuple[Path, CallTally] | None = None


def pytest_configure(config) -> None:
    """Loaded as a plugin: count when the script asked for it (it sets the environment variables)."""
    global _plugin_tally
    path = os.environ.get(CALLS_JSON_ENV)
    if path:
        tally = CallTally()
        tally.problems = install_counters(os.environ.get(CALLS_TARGETS_ENV, "").split(","), tally)
        _plugin_tally = (Path(path), tally)


def pytest_unconfigure(config) -> None:
    if _plugin_tally is not None:
        path, tally = _plugin_tally
        tally.problems += stuck_patches()
        path.write_text(json.dumps(tally.to_json(), indent=1) + "\n")


# --------------------------------------------------------------------------------------------------
# assembling the test trees


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kwargs)


def git_dir_for(source: str, ref: str, cache: Path, name: str) -> str:
    """A local git directory (bare or not) is used as it is; a URL is cloned once, shallow, at ``ref``."""
    if Path(source).is_dir():
        return source
    clone = cache / "git" / f"{name}-{ref}.git"
    if not clone.exists():
        clone.parent.mkdir(parents=True, exist_ok=True)
        run(["git", "clone", "--bare", "--depth", "1", "--branch", ref, source, str(clone)])
    return str(clone)


def git_extract(git_dir: str, ref: str, paths: list[str], into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    archive = run(["git", "-C", git_dir, "archive", "--format=tar", ref, *paths], stdout=subprocess.PIPE).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


def overlay_sdist_tests(version: str, cache: Path, tree: Path) -> None:
    """Copy the installed release's common test files (``tests/*.py``) and pyproject over the tree."""
    sdist_dir = cache / "sdist"
    sdist = sdist_dir / f"transformers-{version}.tar.gz"
    if not sdist.exists():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        run([*pip, f"transformers=={version}", "-d", str(sdist_dir)])
    prefix = f"transformers-{version}/"
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            relative = member.name.removeprefix(prefix)
            top_level_test = relative.startswith("tests/") and relative.count("/") == 1 and relative.endswith(".py")
            if member.isfile() and (top_level_test or relative == "pyproject.toml"):
                member.name = relative
                tar.extract(member, tree, filter="data")


# The sdist lacks this helper; only multi-process tests (deselected by marker) call into it.
DISTRIBUTED_STUB = '''"""Stub written by fastgen's scripts/upstream_tests.py: the sdist lacks this file."""


def __getattr__(name):
    def unavailable(*args, **kwargs):
        raise RuntimeError(f"distributed_testing_utils.{name} is a stub (multi-process tests are deselected)")

    return unavailable
'''


TESTER_DEFAULTS = "_TEXT_MODEL_TESTER_DEFAULTS"
# How the tagged testers import it: inside a parenthesised import (causal_lm_tester.py) or on one line
# (multimodal_tester.py, which gemma3's VLM tests import).
_TESTER_DEFAULTS_IMPORT = re.compile(
    rf"^    {TESTER_DEFAULTS},\n|^from transformers\.testing_utils import {TESTER_DEFAULTS}\n", re.MULTILINE
)


def shim_tester_defaults(code: str, literal: str) -> str | None:
    """``code`` with its import of ``_TEXT_MODEL_TESTER_DEFAULTS`` replaced by a try/except that falls back
    to ``literal`` (the tagged release's dict), or None if ``code`` does not import it."""
    anchor = "from .test_configuration_common import ConfigTester\n"
    if not _TESTER_DEFAULTS_IMPORT.search(code) or anchor not in code:
        return None
    shim = (
        f"\ntry:\n    from transformers.testing_utils import {TESTER_DEFAULTS}\n"
        f"except ImportError:  # removed in transformers 5.24 (shim by fastgen's scripts/upstream_tests.py)\n"
        + "".join(f"    {line}\n" for line in literal.splitlines())
    )
    code = _TESTER_DEFAULTS_IMPORT.sub("", code, count=1)
    return code.replace(anchor, shim + "\n" + anchor, 1)


def shim_removed_tester_defaults(git_dir: str, ref: str, tree: Path) -> None:
    """The tagged ``tests/*_tester.py`` import ``_TEXT_MODEL_TESTER_DEFAULTS`` from
    ``transformers.testing_utils``, which 5.24 removed: fall back to the tagged release's own dict."""
    literal = None
    for tester in sorted((tree / "tests").glob("*.py")):
        if not _TESTER_DEFAULTS_IMPORT.search(tester.read_text()):
            continue
        if literal is None:
            source = run(
                ["git", "-C", git_dir, "show", f"{ref}:src/transformers/testing_utils.py"], stdout=subprocess.PIPE
            )
            text = source.stdout.decode()
            start = text.index(f"{TESTER_DEFAULTS} = {{")
            literal = text[start : text.index("\n}\n", start) + 2]
        shimmed = shim_tester_defaults(tester.read_text(), literal)
        if shimmed is not None:
            tester.write_text(shimmed)


def assemble_transformers(args: argparse.Namespace) -> Path:
    version = importlib.metadata.version("transformers")
    tree = args.cache_dir / f"transformers-{args.ref}+sdist-{version}"
    if not (tree / ".assembled").exists():
        if tree.exists():
            shutil.rmtree(tree)
        git_dir = git_dir_for(args.transformers_git, args.ref, args.cache_dir, "transformers")
        git_extract(git_dir, args.ref, ["tests", "conftest.py", "pyproject.toml", "utils"], tree)
        overlay_sdist_tests(version, args.cache_dir, tree)
        shim_removed_tester_defaults(git_dir, args.ref, tree)
        stub = tree / "tests/distributed_testing_utils.py"
        if not stub.exists():
            stub.write_text(DISTRIBUTED_STUB)
        (tree / ".assembled").write_text(f"{args.transformers_git} {args.ref} + sdist {version}\n")
    # tests/test_pipeline_mixin.py reads sources from src/transformers: point it at the installed code.
    link = tree / "src/transformers"
    installed = Path(importlib.util.find_spec("transformers").origin).parent
    if link.is_symlink() and link.resolve() != installed:
        link.unlink()
    if not link.is_symlink():
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(installed)
    return tree


def assemble_fairseq(args: argparse.Namespace) -> Path:
    # Only tests/ is extracted, so ``import fairseq`` resolves to the installed package.
    tree = args.cache_dir / f"fairseq-{args.fairseq_ref}"
    if not (tree / ".assembled").exists():
        if tree.exists():
            shutil.rmtree(tree)
        git_dir = git_dir_for(args.fairseq_git, args.fairseq_ref, args.cache_dir, "fairseq")
        git_extract(git_dir, args.fairseq_ref, ["tests"], tree)
        (tree / ".assembled").write_text(f"{args.fairseq_git} {args.fairseq_ref}\n")
    return tree


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package ("google" for "google.protobuf")
        return False


def ensure_test_deps() -> None:
    missing = [requirement for module, requirement in TEST_DEPS.items() if not _importable(module)]
    if missing:
        run([sys.executable, "-m", "pip", "install", "-q", *missing])


# --------------------------------------------------------------------------------------------------
# running


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    tree: Path
    files: tuple[str, ...]
    markers: str
    deselect: str
    env: dict[str, str]
    generate_targets: tuple[str, ...] = ()


def make_suites(args: argparse.Namespace) -> list[Suite]:
    suites = []
    if args.suite in ("transformers", "all"):
        suites.append(
            Suite(
                "transformers",
                assemble_transformers(args),
                tuple(args.files or transformers_files()),
                TRANSFORMERS_MARKERS,
                TRANSFORMERS_DESELECT,
                {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                GENERATE_TARGETS["transformers"],
            )
        )
    if args.suite in ("fairseq", "all"):
        suites.append(
            Suite(
                "fairseq",
                assemble_fairseq(args),
                tuple(args.files or FAIRSEQ_FILES),
                "",
                FAIRSEQ_DESELECT,
                # ve-fairseq's checkpoint loading predates torch 2.6's weights_only default.
                {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},
                GENERATE_TARGETS["fairseq"],
            )
        )
    return suites


def keyword_expression(suite: Suite, user_k: str | None) -> str:
    return suite.deselect if not user_k else f"({suite.deselect}) and ({user_k})"


def xml_path(cache: Path, mode: str, suite: Suite, test_file: str, user_k: str | None) -> Path:
    """Named after the file and a hash of the whole selection, so a cached plain run is reused only
    for the tests it ran (a changed deselection or ``-k`` gets a new file)."""
    selection = f"{suite.markers}|{keyword_expression(suite, user_k)}"
    stem = test_file.removesuffix(".py").replace("/", "__")
    return cache / "results" / mode / suite.name / f"{stem}--{hashlib.sha1(selection.encode()).hexdigest()[:10]}.xml"


def run_file(suite: Suite, test_file: str, mode: str, out: Path, args: argparse.Namespace) -> float:
    """One pytest process per file and mode, so one crash or hang costs one file. Returns seconds."""
    keyword = keyword_expression(suite, args.k)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    if importlib.util.find_spec("xdist") is not None:  # the suites' own addopts may ask for it; one process
        cmd += ["-n", "0"]
    if mode == "fastgen":
        cmd += ["-p", "fastgen", "-p", PLUGIN]
    if importlib.util.find_spec("pytest_timeout") is not None:  # installed with the suites' extras
        cmd.append(f"--timeout={args.timeout}")
    cmd += [f"--junitxml={out}", "-k", keyword]
    if suite.markers:
        cmd += ["-m", suite.markers]
    cmd.append(test_file)
    env = {k: v for k, v in os.environ.items() if k not in ("RUN_SLOW", "FASTGEN_DISABLE", "PYTEST_ADDOPTS")}
    env.update(suite.env)
    env.setdefault("OMP_NUM_THREADS", "1")
    if mode == "plain":
        env["FASTGEN_DISABLE"] = "1"
    else:  # the plugin half of this file counts what each generate call did
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(Path(__file__).parent), env.get("PYTHONPATH"))))
        env[CALLS_JSON_ENV] = str(tally_path(out))
        env[CALLS_TARGETS_ENV] = ",".join(suite.generate_targets)
        tally_path(out).unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(out.with_suffix(".log"), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            subprocess.run(
                cmd, cwd=suite.tree, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.file_timeout
            )
        except subprocess.TimeoutExpired:
            log.write(f"\nupstream_tests.py: killed after {args.file_timeout} s\n")
    seconds = time.monotonic() - started
    print(f"{suite.name} {mode:7s} {test_file}: {seconds:.0f} s", flush=True)
    return seconds


def tally_path(fastgen_xml: Path) -> Path:
    return fastgen_xml.with_suffix(".calls.json")


def plain_xml_for(suite: Suite, test_file: str, args: argparse.Namespace) -> tuple[Path, bool]:
    """The plain XML to use and whether it covers more tests than this run selects (a cached run
    without ``-k`` reused for a ``-k`` run), in which case only the tests the fastgen run selected
    are compared."""
    exact = xml_path(args.cache_dir, "plain", suite, test_file, args.k)
    if args.plain_cache and not exact.exists() and args.k:
        full = xml_path(args.cache_dir, "plain", suite, test_file, None)
        if full.exists():
            return full, True
    return exact, False


@dataclasses.dataclass
class SuiteRun:
    comparison: Comparison
    seconds: dict[str, float]
    calls: dict[str, CallTally | None]  # per test file: what fastgen did in its generate calls (None: no tally)
    missing_files: list[str]  # selected files the assembled tree lacks (a family newer than the tagged tree)

    def total_calls(self) -> CallTally:
        total = CallTally()
        for tally in self.calls.values():
            if tally is not None:
                total.merge(tally)
        return total

    def to_json(self) -> dict:
        return {
            **self.comparison.to_json(),
            "missing_files": self.missing_files,
            "generate_calls": {
                "total": self.total_calls().to_json(),
                "per_file": {f: None if t is None else t.to_json() for f, t in self.calls.items()},
            },
            "seconds": self.seconds,
        }


def format_calls(run: SuiteRun) -> str:
    lines = ["what fastgen did in the generate calls (fastgen run), per file:"]
    for test_file, tally in run.calls.items():
        lines.append(f"{test_file}:")
        lines.extend(
            format_tally(tally) if tally is not None else ["  no tally written (pytest crashed or was killed)"]
        )
    lines.append("all files:")
    total = run.total_calls()
    lines.extend(format_tally(total))
    lines.extend(f"  problem: {problem}" for problem in total.problems)
    return "\n".join(lines)


def run_suite(suite: Suite, args: argparse.Namespace) -> SuiteRun:
    missing = [f for f in suite.files if not (suite.tree / f).is_file()]
    for test_file in missing:
        print(f"{suite.name}: {test_file} is missing in {suite.tree.name}: not run", flush=True)
    files = [f for f in suite.files if f not in missing]
    jobs = []
    plain_xmls = {}
    for test_file in files:
        plain_xml, superset = plain_xml_for(suite, test_file, args)
        plain_xmls[test_file] = (plain_xml, superset)
        if args.run in ("both", "plain") and not (args.plain_cache and plain_xml.exists()):
            jobs.append((test_file, "plain", plain_xml))
        if args.run in ("both", "fastgen"):
            jobs.append((test_file, "fastgen", xml_path(args.cache_dir, "fastgen", suite, test_file, args.k)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_file, suite, f, mode, out, args): (f, mode) for f, mode, out in jobs}
        seconds = {f"{mode} {f}": future.result() for future, (f, mode) in futures.items()}
    plain, fastgen, calls = {}, {}, {}
    for test_file in files:
        plain_xml, superset = plain_xmls[test_file]
        fastgen_xml = xml_path(args.cache_dir, "fastgen", suite, test_file, args.k)
        file_plain = read_results(plain_xml)
        file_fastgen = file_plain if args.run == "plain" else read_results(fastgen_xml)
        if superset:
            file_plain = {t: r for t, r in file_plain.items() if t in file_fastgen}
        plain.update(file_plain)
        fastgen.update(file_fastgen)
        calls[test_file] = None if args.run == "plain" else read_tally(tally_path(fastgen_xml))
    return SuiteRun(compare(plain, fastgen), seconds, calls, missing)


def read_results(path: Path) -> dict[str, TestResult]:
    """A missing or unreadable XML (pytest crashed or was killed) reads as one error for the file."""
    try:
        return parse_junit(path)
    except (OSError, ET.ParseError) as exc:
        return {f"{path.name}::<no junit xml>": TestResult("error", f"{type(exc).__name__}: {exc} (see .log)")}


def fastgen_revision() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=("transformers", "fairseq", "all"), default="all")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="default: %(default)s")
    parser.add_argument("--transformers-git", default=TRANSFORMERS_GIT, help="URL or local (bare) git directory")
    parser.add_argument("--ref", default=TRANSFORMERS_REF, help="Transformers tag (default %(default)s)")
    parser.add_argument("--fairseq-git", default=FAIRSEQ_GIT, help="URL or local (bare) git directory")
    parser.add_argument("--fairseq-ref", default=FAIRSEQ_REF, help="fairseq tag (default %(default)s)")
    parser.add_argument("--files", nargs="+", help="test files relative to the suite's tree (one --suite only)")
    parser.add_argument("-k", help="pytest -k expression, and-ed with the built-in deselection")
    parser.add_argument("--plain-cache", action="store_true", help="reuse the plain run's XML where present")
    parser.add_argument(
        "--run",
        choices=("both", "plain", "fastgen", "none"),
        default="both",
        help="which sides to run (default %(default)s); the others are read from the cache: 'plain' fills the "
        "plain cache, 'fastgen' and 'none' compare with the cached results (two processes can run the sides at once)",
    )
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("--file-timeout", type=int, default=7200, help="seconds per pytest process")
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes at once")
    parser.add_argument("--no-install", action="store_true", help="do not pip-install missing test deps")
    parser.add_argument("--prepare-only", action="store_true", help="assemble the trees and deps, run nothing")
    parser.add_argument("--json", type=Path, help="write counts and differing tests here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("PLAIN_XML", "FASTGEN_XML"), help="only compare")
    args = parser.parse_args(argv)
    if args.files and args.suite == "all":
        parser.error("--files needs --suite transformers or --suite fairseq")
    args.cache_dir = args.cache_dir.expanduser().resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        comparison = compare(parse_junit(args.compare[0]), parse_junit(args.compare[1]))
        runs = {"compare": SuiteRun(comparison, {}, {}, [])}
    else:
        if not args.no_install:
            ensure_test_deps()
        suites = make_suites(args)
        if args.prepare_only:
            for suite in suites:
                print(f"{suite.name}: {suite.tree}")
            return 0
        runs = {suite.name: run_suite(suite, args) for suite in suites}
    for name, suite_run in runs.items():
        print(format_comparison(name, suite_run.comparison))
        if suite_run.missing_files:
            print(f"missing in the assembled tree, not run: {', '.join(suite_run.missing_files)}")
        if suite_run.calls and args.run != "plain":
            print(format_calls(suite_run))
    if args.json:
        summary = {
            "fastgen": fastgen_revision(),
            "transformers": importlib.metadata.version("transformers"),
            "transformers_tests": f"{args.transformers_git} {args.ref}",
            "fairseq_tests": f"{args.fairseq_git} {args.fairseq_ref}",
            "k": args.k,
            "plain_cache": args.plain_cache,
            "run": args.run,
            "load_average_at_end": os.getloadavg(),
            "suites": {name: suite_run.to_json() for name, suite_run in runs.items()},
        }
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    comparisons = [suite_run.comparison for suite_run in runs.values()]
    differs = any(c.differing or c.only_in_plain or c.only_in_fastgen for c in comparisons)
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
