"""Another transformers release over .venv's packages, in a folder put first on PYTHONPATH (no new venv).

Why: CI runs some tests on older transformers releases; a fresh virtual environment for each reinstalls torch,
fairseq and the rest (~1.7 min each on the 2-core CI machine) although only transformers and perhaps a pin or
two differ. Here ``pip install --target DIR --no-deps`` puts that release in DIR, then every requirement of each
package in DIR is checked against what the interpreter would import with DIR first; an unmet one is installed
into DIR too (its newest version that satisfies it, again without dependencies) and checked in turn. Exit 0:
``PYTHONPATH=DIR python`` sees a consistent set. Exit 1: it could not be made consistent (say why): build a
full venv instead.

    python scripts/overlay_env.py .venv-previous "transformers==5.23.0"
    PYTHONPATH=.venv-previous .venv/bin/python -m pytest ...
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

MAX_ROUNDS = 5  # pins pulled in by pins: a release's requirements settle within a round or two


def _distribution(name: str, path: list[str]) -> metadata.Distribution | None:
    """The distribution ``import`` would see first on ``path`` (None: not installed)."""
    for folder in path:
        for dist in metadata.distributions(path=[folder]):
            if canonicalize_name(dist.metadata["Name"]) == canonicalize_name(name):
                return dist
    return None


def unmet(overlay: Path) -> list[Requirement]:
    """Requirements of the overlay's packages (no extras) that the overlay-first path does not satisfy."""
    path = [str(overlay), *sys.path]
    missing = []
    for dist in metadata.distributions(path=[str(overlay)]):
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            found = _distribution(requirement.name, path)
            if found is None or not requirement.specifier.contains(found.version, prereleases=True):
                missing.append(requirement)
    return missing


def _install(overlay: Path, specs: list[str]) -> None:
    command = [sys.executable, "-m", "pip", "install", "-q", "--upgrade", "--no-deps", "--target", str(overlay), *specs]
    subprocess.run(command, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overlay", type=Path, help="the folder to fill (and put first on PYTHONPATH)")
    parser.add_argument("spec", help='the release, as pip takes it: "transformers==5.23.0"')
    args = parser.parse_args(argv)
    wanted = Requirement(args.spec)
    present = _distribution(wanted.name, [str(args.overlay)]) if args.overlay.is_dir() else None
    if present is None or not wanted.specifier.contains(present.version, prereleases=True):
        _install(args.overlay, [args.spec])
    for _ in range(MAX_ROUNDS):
        missing = unmet(args.overlay)
        if not missing:
            print(f"{args.overlay}: {args.spec} over {sys.prefix}'s packages, every requirement met")
            return 0
        print(f"{args.overlay}: adding {', '.join(map(str, missing))}")
        _install(args.overlay, [str(requirement) for requirement in missing])
    print(f"{args.overlay}: requirements still unmet after {MAX_ROUNDS} rounds: {', '.join(map(str, missing))}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
