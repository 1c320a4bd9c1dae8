"""Without fairseq, ``fastgen-generate`` (even ``--help``) says in one line what to install, exit status 2."""

from __future__ import annotations

import sys


def test_help_without_fairseq_is_one_line_naming_the_install(monkeypatch, capsys):
    from fastgen.cli.generate import INSTALL_FAIRSEQ, main

    monkeypatch.setitem(sys.modules, "fairseq", None)  # `import fairseq` now raises ModuleNotFoundError
    code = main(["--help"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and INSTALL_FAIRSEQ in err and "Traceback" not in err
