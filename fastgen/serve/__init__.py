"""``fastgen-serve``: an HTTP server that batches concurrent requests continuously (greedy, sampling and
beam search; encoder-decoder and decoder-only models).

One process serves one model: an engine thread (:mod:`fastgen.serve.engine`) owns it and runs the
continuous-batching scheduler of :func:`fastgen.generate_many` in its online form, so requests join the
running batch at the next step and leave when done, each result what ``generate`` returns for that input
alone. The app (:mod:`fastgen.serve.app`, Starlette under uvicorn) checks requests and bridges them to the
engine. Start it with ``fastgen-serve MODEL_DIR`` or ``python -m fastgen.serve MODEL_DIR``; in Python,
:func:`create_app` takes a loaded model. Needs the ``serve`` extra (``pip install "fastgen-seq[serve]"``).
"""

from fastgen.serve.app import create_app

__all__ = ["create_app"]
