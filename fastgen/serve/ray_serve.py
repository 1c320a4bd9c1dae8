"""fastgen-serve as a Ray Serve deployment: the same app, built from the same arguments, one per replica.

Each replica runs what ``fastgen-serve`` runs (:func:`fastgen.serve.cli.build_app`: the model loaded, the
features switched, the app with its engine thread); Ray's HTTP proxy takes the place of uvicorn and spreads
requests over the replicas. Needs the ``ray`` extra (``pip install "fastgen-seq[serve,ray]"``).

    serve run fastgen.serve.ray_serve:app_builder argv="./my-model --threads 4" num_replicas=2

or in Python::

    from ray import serve
    from fastgen.serve.ray_serve import deployment

    serve.run(deployment(["./my-model", "--threads", "4"], num_replicas=2))
"""

from __future__ import annotations

import shlex
from typing import Any

from ray import serve

from fastgen.serve.cli import build_app, build_parser


def deployment(argv: list[str], **options: Any) -> serve.Application:
    """The bound deployment; ``argv`` are ``fastgen-serve``'s arguments (``--host`` and ``--port`` are Ray's
    business: ``serve.start(http_options=...)``), ``options`` Ray Serve's deployment options.

    Defaults that differ from Ray's: a replica reserves as many CPUs as it has torch threads, and takes as
    many requests at once as its engine holds (``--max-queue`` waiting plus ``--batch-rows`` in the batch),
    so requests reach the running batch and a full replica answers 429 itself. Ray's default of 5 at once
    would leave the batch nearly empty.
    """
    args = build_parser().parse_args(argv)  # a wrong argument fails here, not in every replica
    options.setdefault("ray_actor_options", {"num_cpus": args.threads or 1})
    options.setdefault("max_ongoing_requests", args.max_queue + args.batch_rows)
    ingress = serve.ingress(lambda: build_app(args)[0])()  # the app is built in the replica
    return serve.deployment(ingress, name="fastgen-serve", **options).bind()


def app_builder(args: dict[str, str]) -> serve.Application:
    """For ``serve run``: ``argv`` (one string, fastgen-serve's arguments) and ``num_replicas``."""
    unknown = set(args) - {"argv", "num_replicas"}
    if unknown:
        raise ValueError(f"unknown arguments {sorted(unknown)} (accepted: argv, num_replicas)")
    return deployment(shlex.split(args["argv"]), num_replicas=int(args.get("num_replicas", 1)))
