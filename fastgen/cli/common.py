"""What both CLIs share: pipeline options, logging to stderr, checkpoint loading, clean failures."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

logger = logging.getLogger("fastgen.cli")


class UsageError(ValueError):
    """A bad argument or path, found before anything is written: one line, exit status 2."""


def rejected(kwargs: dict, exc: Exception) -> UsageError:
    """Generation arguments that ``generate`` refused (or continuous batching, which checks them as it does):
    one line, whatever line breaks upstream's message has."""
    return UsageError(f"the generation arguments {kwargs} were rejected: {' '.join(str(exc).split())}")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def check_input_file(path: Path, option: str) -> None:
    if not path.exists():
        raise UsageError(f"{option} {path}: no such file")
    if not path.is_file():
        raise UsageError(f"{option} {path}: not a regular file")


def check_output_file(path: Path, option: str) -> None:
    """The output (written later through ``path.partial``) must be a file in a directory we can create."""
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a directory; give a file name")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{option} {path}: {parent} is not a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UsageError(f"{option} {path}: cannot write in {parent}")
            break


def add_pipeline_args(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run from the valid prefix of its output (needs an output file)",
    )
    group.add_argument(
        "--postprocess-workers",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="post-processing worker processes (default on CUDA: CPUs - 1, at most 4; on CPU: 0, i.e. "
        "post-process in a background thread)",
    )
    group.add_argument(
        "--no-pipeline",
        action="store_true",
        help="post-process each batch before generating the next (the synchronous path, for comparison)",
    )


def add_mode_arg(group: argparse._ActionsContainer) -> None:
    from fastgen.optimizer.registry import MODES

    group.add_argument(
        "--mode",
        type=str.lower,
        choices=list(MODES),
        default=None,
        help="fastgen's mode for this run (as FASTGEN_MODE): exact (every default feature, tokens equal "
        "upstream's), fast (and fp32 linears on packed weights, oneDNN or MKL, CPU) or int8 (and int8 linears, "
        "CPU); default: FASTGEN_MODE, else exact",
    )


def mode_block(mode: str | None, without: Iterable[str] = ()) -> contextlib.AbstractContextManager[None]:
    """The run in ``--mode`` (minus the features ``without`` names): a block of the thread that calls
    ``generate`` (the CLIs' main thread; their other threads only post-process), so fastgen's process-wide
    selection is left as it was. Without ``--mode``: that selection (``FASTGEN_MODE`` / ``FASTGEN_FEATURES``), less
    ``without`` (in a block too)."""
    import fastgen
    from fastgen.optimizer.registry import feature_enabled, mode_features

    if mode is None:
        if not without or not fastgen.is_enabled():
            return contextlib.nullcontext()
        chosen = [f for f in fastgen.known_features() if feature_enabled(f) and f not in set(without)]
        return fastgen.patched(chosen)

    left = mode_features(mode) - set(without)
    return fastgen.patched(mode=mode) if left == mode_features(mode) else fastgen.patched(sorted(left))


def default_workers(on_cuda: bool) -> int:
    """Worker processes pay a start-up (imports) and, on CPU, compete with generation for the same
    cores: measured on a 2-core CPU they cost more than they save (benchmarks/results/
    cli-pipeline-cpu.json), so CPU runs post-process in the background thread by default."""
    if not on_cuda:
        return 0
    return max(1, min(4, (os.cpu_count() or 2) - 1))


def setup_logging() -> None:
    """fairseq's log format, on stderr: the output stream carries results only."""
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
        stream=sys.stderr,
    )


def allow_full_checkpoint_loading() -> None:
    """fairseq checkpoints pickle argparse/omegaconf objects, which torch>=2.6's default
    ``torch.load(weights_only=True)`` refuses. Allow them for this process, saying so once,
    unless the user forces weights-only loading."""
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in {"1", "true", "yes", "y"}:
        return
    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD") is None:
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        logger.info(
            "loading checkpoints with torch.load(weights_only=False) as fairseq needs on torch>=2.6 "
            "(it unpickles Python objects: load only checkpoints you trust; "
            "TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 refuses them)"
        )


def fail(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code
