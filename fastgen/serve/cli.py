"""``fastgen-serve MODEL_DIR``: load a model and its tokenizer, pick fastgen's mode, run the app under uvicorn.

The model directory is what ``save_pretrained`` writes (a Hugging Face model id works too where the
machine can download). Generation defaults come from the model's ``generation_config``; a request's
parameters override them per request.
"""

from __future__ import annotations

import argparse
import inspect
import logging
from typing import Any

import torch

import fastgen
from fastgen.optimizer.registry import OPT_IN_FEATURES

log = logging.getLogger("fastgen")

#: --mode: fastgen's features on top of the defaults (every feature but the opt-in ones)
MODES = {"exact": (), "fast": ("fast_gemm",), "int8": ("int8",)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastgen-serve", description="Serve a Transformers model over HTTP with continuous batching."
    )
    parser.add_argument("model", help="model directory (save_pretrained) or hub id")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    parser.add_argument("--name", help="model name in the API (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--mode",
        choices=sorted(MODES),
        default="exact",
        help="exact: fastgen's default features (outputs equal upstream); fast: + fast_gemm; int8: + int8",
    )
    parser.add_argument("--features", help="comma-separated fastgen features (overrides --mode)")
    parser.add_argument("--batch-rows", type=int, default=64, help="decoder rows per step (inputs x beams)")
    parser.add_argument("--max-queue", type=int, default=256, help="inputs waiting before 429")
    parser.add_argument("--max-input-tokens", type=int, help="default: the model's max_position_embeddings")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="largest max_new_tokens a request may ask")
    parser.add_argument("--max-inputs", type=int, default=64, help="inputs per request at most")
    parser.add_argument("--log-level", default="info")
    return parser


def select_features(mode: str, features: str | None) -> None:
    """Switch fastgen's features: ``--features`` as given, else the mode (the mode API where it exists)."""
    if features is not None:
        fastgen.enable(features)
        return
    if "mode" in inspect.signature(fastgen.enable).parameters:
        fastgen.enable(mode=mode)
        return
    defaults = [name for name in fastgen.known_features() if name not in OPT_IN_FEATURES]
    fastgen.enable(defaults + list(MODES[mode]))


def load(path: str, tokenizer_path: str | None, device: str, dtype: str) -> tuple[Any, Any]:
    """The model (eval mode, on ``device``) and its tokenizer (None when the directory has none)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=_DTYPES[dtype]).to(device).eval()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path or path)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("fastgen-serve: no tokenizer (%s): requests must send token ids", exc)
        tokenizer = None
    return model, tokenizer


def build_app(args: argparse.Namespace) -> tuple[Any, str]:
    """The app ``fastgen-serve``'s arguments describe, and the model's name: torch threads and fastgen's
    features set, the model loaded. Shared by the command line and the Ray Serve deployment."""
    from fastgen.serve.app import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    select_features(args.mode, args.features)
    model, tokenizer = load(args.model, args.tokenizer, args.device, args.dtype)
    name = args.name or args.model.rstrip("/").split("/")[-1]
    app = create_app(
        model,
        tokenizer,
        name=name,
        batch_rows=args.batch_rows,
        max_queue=args.max_queue,
        max_input_tokens=args.max_input_tokens,
        max_new_tokens=args.max_new_tokens,
        max_inputs=args.max_inputs,
    )
    return app, name


def cli_main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, name = build_app(args)
    log.info("fastgen-serve: %s on http://%s:%d (mode %s)", name, args.host, args.port, args.mode)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=None)


if __name__ == "__main__":
    cli_main()
