"""pytest plugin: shadow every beam search call of a test suite with upstream's and fastgen's loop.

Transformers' own tests rarely compare beam search outputs with anything, and most of their beam calls
fall back (``output_logits``, repetition penalty, multi-token bad words), so "same outcome with and
without fastgen" (``scripts/upstream_tests.py``) says little about fastgen's loop (feature ``beam``).
This plugin wraps ``GenerationMixin._beam_search``: for every call it runs upstream's original loop
and fastgen's loop on deep copies of the call's inputs, as called and, with ``--beam-shadow-strip``,
without what fastgen's loop does not serve (``output_logits`` / ``output_attentions`` /
``output_hidden_states`` and the logits processors it does not support), and compares sequences,
``sequences_scores``, per-step scores and ``beam_indices``. With ``--beam-shadow-tensor`` a dict call
is also compared as a tensor call (fastgen's lazy stop check; finished inputs may leave the batch).
Then the call itself runs as usual, so test outcomes are unchanged. A summary line per kind of call
and every mismatch (with its test id) is printed at the end and written to ``--beam-shadow-out``.

    cd ~/.cache/fastgen/upstream-tests/transformers-v5.15.0+sdist-5.23.0
    FASTGEN_FEATURES=dedup,ngram,speculative,beam PYTHONPATH=$REPO/scripts OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \\
      $REPO/.venv/bin/python -m pytest -q -p fastgen -p beam_shadow --beam-shadow-strip --beam-shadow-tensor \\
      -k "generate or beam" tests/models/bart/test_modeling_bart.py
"""

from __future__ import annotations

import collections
import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import fastgen  # before anything imports transformers' generation module
from fastgen.optimizer.transformers.contract import CACHE

_counts: collections.Counter[str] = collections.Counter()
_mismatches: list[str] = []
_current_test = {"id": "<collection>"}
OUTPUT_FLAGS = ("output_logits", "output_attentions", "output_hidden_states")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("beam-shadow")
    group.addoption("--beam-shadow-strip", action="store_true", help="also compare calls fastgen would hand back")
    group.addoption("--beam-shadow-tensor", action="store_true", help="also compare dict calls as tensor calls")
    group.addoption("--beam-shadow-out", type=Path, help="write the summary here")


def pytest_runtest_setup(item: pytest.Item) -> None:
    _current_test["id"] = item.nodeid


def _close(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    inf = torch.isinf(a)
    return torch.equal(inf, torch.isinf(b)) and torch.allclose(a[~inf], b[~inf], atol=atol, rtol=1e-5)


def differences(reference: Any, candidate: Any) -> list[str]:
    """What differs between upstream's and fastgen's result of one call (empty: nothing)."""
    if isinstance(reference, torch.Tensor):
        same = reference.shape == candidate.shape and torch.equal(reference, candidate)
        return [] if same else [f"sequences {reference.tolist()} vs {candidate.tolist()}"]
    found = []
    if reference.sequences.shape != candidate.sequences.shape or not torch.equal(
        reference.sequences, candidate.sequences
    ):
        found.append(f"sequences {reference.sequences.tolist()} vs {candidate.sequences.tolist()}")
    for name in ("sequences_scores", "beam_indices"):
        a, b = getattr(reference, name, None), getattr(candidate, name, None)
        if (a is None) != (b is None) or (
            a is not None and (a.shape != b.shape or not _close(a.float(), b.float(), 1e-5))
        ):
            found.append(f"{name} {a} vs {b}")
    a, b = reference.scores, candidate.scores
    if (a is None) != (b is None) or (a is not None and len(a) != len(b)):
        found.append("number of per-step scores")
    elif a is not None:
        steps = [step for step, (x, y) in enumerate(zip(a, b, strict=True)) if not _close(x, y, 1e-4)]
        if steps:
            found.append(f"per-step scores at steps {steps}")
    if (getattr(reference, CACHE, None) is None) != (getattr(candidate, CACHE, None) is None):
        found.append("past_key_values returned on one side only")
    return found


def pytest_configure(config: pytest.Config) -> None:
    import transformers.generation.utils as generation_utils  # after fastgen: its pending patches apply
    from transformers.generation.logits_process import LogitsProcessorList

    from fastgen.optimizer import registry
    from fastgen.optimizer.transformers import beam_search

    patched = generation_utils.GenerationMixin.__dict__["_beam_search"]
    original = getattr(patched, "__wrapped__", None)
    if original is None:
        _counts["beam patch not installed (FASTGEN_FEATURES without beam?)"] += 1
        return
    strip, tensor_too = config.getoption("--beam-shadow-strip"), config.getoption("--beam-shadow-tensor")

    def compare(model, input_ids, processors, criteria, generation_config, synced_gpus, model_kwargs) -> None:
        settings = copy.deepcopy(generation_config)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        vocab = getattr(head, "out_features", None)
        stripped = []
        if strip:
            stripped = [flag for flag in OUTPUT_FLAGS if getattr(settings, flag, False)]
            for flag in stripped:
                setattr(settings, flag, False)
            kept = [
                p
                for p in processors or ()
                if type(p) in beam_search._PROCESSORS and beam_search._processor_problem(p, vocab) is None
            ]
            stripped += [type(p).__name__ for p in processors or () if not any(p is k for k in kept)]
            processors = LogitsProcessorList(kept)
        reason = beam_search.unsupported_reason(settings, processors, criteria, synced_gpus, vocab)
        if reason is not None:
            _counts[f"not compared: {reason}"] += 1
            return
        variants = [("as called", settings)]
        if tensor_too and settings.return_dict_in_generate:
            as_tensor = copy.deepcopy(settings)
            as_tensor.return_dict_in_generate = False
            variants.append(("as a tensor call", as_tensor))
        for variant, variant_settings in variants:
            rng = torch.get_rng_state()
            with torch.no_grad():
                reference = original(
                    model, input_ids.clone(), processors, criteria, variant_settings, synced_gpus,
                    **copy.deepcopy(model_kwargs),
                )  # fmt: skip
                torch.set_rng_state(rng)
                with fastgen.report() as report:
                    candidate = beam_search._beam_search(
                        model, input_ids.clone(), processors, criteria, variant_settings, copy.deepcopy(model_kwargs)
                    )
            torch.set_rng_state(rng)
            label = f"compared {variant}" + (f" without {', '.join(stripped)}" if stripped else "")
            _counts[label] += 1
            if "finished inputs left the batch" in report.ran.get("beam", ()):
                _counts["  calls in which finished inputs left fastgen's batch"] += 1
            found = differences(reference, candidate)
            if found:
                _mismatches.append(f"{_current_test['id']} [{variant}]: {'; '.join(found)[:800]}")

    def shadowed(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, **kw):
        if registry.feature_enabled("beam") and registry.active():
            try:
                compare(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, kw)
            except Exception as exc:  # the shadow must never change the test's own outcome
                _counts[f"shadow error {type(exc).__name__}: {str(exc)[:160]}"] += 1
        return patched(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, **kw)

    generation_utils.GenerationMixin._beam_search = shadowed


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    lines = [f"{count:6d} {what}" for what, count in sorted(_counts.items())]
    lines.append(f"{len(_mismatches):6d} mismatches")
    lines += [f"MISMATCH {line}" for line in _mismatches]
    for line in lines:
        terminalreporter.write_line(f"beam-shadow: {line}")
    out = config.getoption("--beam-shadow-out")
    if out:
        out.write_text("\n".join(lines) + "\n")
