"""``fastgen-generate-hf``: text in, text out for a Transformers model saved with ``save_pretrained``.

    fastgen-generate-hf MODEL_DIR --input in.txt --output out.txt [--num-beams 4 --max-new-tokens 64]

One input per line, one output per line in the same order (line breaks inside an output are
written as the two characters ``\\n``; an input skipped with ``--skip-invalid`` gets an empty
line). Inputs are batched by token length within windows of ``--sort-window`` lines; the
device generates while finished batches are decoded in worker processes and the writer emits
each window in input order (``fastgen.cli.pipeline``). ``--resume`` continues a killed run;
under ``torchrun`` each rank takes every world-size-th window and rank 0 merges the output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fastgen  # noqa: F401 - patches transformers
from fastgen.cli import distributed, heap
from fastgen.cli.common import (
    OneLineErrorParser,
    UsageError,
    add_mode_arg,
    add_pipeline_args,
    check_input_file,
    check_output_file,
    default_workers,
    fail,
    mode_block,
    non_negative_int,
    positive_int,
    rejected,
    setup_logging,
)
from fastgen.cli.hf_inputs import Batch, InputLine, check_lengths, plan, read_lines
from fastgen.cli.journal import Journal, ResumeError, merge_parts
from fastgen.cli.journal import exists as journal_exists
from fastgen.cli.pipeline import AsyncPipeline, PipelineError, Progress, make_executor

logger = logging.getLogger("fastgen.cli.generate_hf")

_TOKENIZER: Any = None


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="fastgen-generate-hf", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="directory written by save_pretrained (model and tokenizer)")
    parser.add_argument(
        "--input",
        type=Path,
        required=True,
        help="UTF-8 text, one input per line (a byte-order mark at the start is dropped: read as utf-8-sig)",
    )
    parser.add_argument("--output", type=Path, required=True, help="one output line per input line")
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--num-beams", type=positive_int, default=None)
    parser.add_argument("--max-new-tokens", type=positive_int, default=None)
    parser.add_argument("--no-repeat-ngram-size", type=non_negative_int, default=None)
    parser.add_argument(
        "--gen",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any generate() argument; VALUE is read as JSON when it parses (4, 0.7, true), else as a string",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="reproducible sampling: input line k (0-based) is sampled from seed SEED + k under continuous "
        "batching (the default), batch k under --no-continuous-batching",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument(
        "--max-input-tokens",
        type=positive_int,
        default=None,
        help="longest input accepted (default: the model's limit)",
    )
    parser.add_argument("--skip-invalid", action="store_true", help="skip malformed or too long lines (counted)")
    parser.add_argument(
        "--sort-window",
        type=positive_int,
        default=None,
        help="lines sorted by length together (default: 16 x batch size)",
    )
    parser.add_argument(
        "--reference", type=Path, default=None, help="references, one per line (utf-8-sig): print BLEU/ROUGE"
    )
    parser.add_argument("--no-progress-bar", action="store_true")
    parser.add_argument(
        "--continuous-batching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="refill the batch as inputs finish, for the runs it serves (default: where it is expected to be "
        "faster, see fastgen.cli.continuous_hf.prefers_static); --no-continuous-batching: static length-sorted "
        "batches, one generate call each",
    )
    add_mode_arg(parser)
    add_pipeline_args(parser)
    return parser


#: generate() arguments that upstream does not check before dividing or looping by them (num_beams=0
#: ends in a ZeroDivisionError there).
POSITIVE_GENERATE_ARGS = ("num_beams", "num_beam_groups", "max_new_tokens", "max_length")


def generate_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for name in ("num_beams", "max_new_tokens", "no_repeat_ngram_size"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    for item in args.gen:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--gen takes KEY=VALUE, got {item!r}")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    for name in POSITIVE_GENERATE_ARGS:
        value = kwargs.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"--gen {name}={value!r}: must be a positive integer")
    if kwargs.get("num_return_sequences", 1) != 1:
        raise UsageError("num_return_sequences must be 1 (one output line per input line)")
    from fastgen.continuous.arguments import check_generate_kwargs  # imports Transformers (--help stays fast)

    try:  # what generate would misread or reject late (length_penalty=abc, attention_mask=...), on both paths
        check_generate_kwargs(kwargs, return_scores=False)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--gen: {exc}") from exc
    return kwargs


def load_tokenizer(model_dir: Path, causal: bool) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if causal:
        tokenizer.padding_side = "left"  # prompts end where generation starts
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_dir: Path, device: str, dtype: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = AutoConfig.from_pretrained(model_dir)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    return auto.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()


def model_input_limit(model: Any, tokenizer: Any, kwargs: dict[str, Any]) -> int | None:
    config = model.config
    limit = None
    for name in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, name, None), int):
            limit = getattr(config, name)
            break
    if isinstance(tokenizer.model_max_length, int) and tokenizer.model_max_length < 10**6:
        limit = min(limit, tokenizer.model_max_length) if limit else tokenizer.model_max_length
    if limit and not config.is_encoder_decoder:
        limit -= kwargs.get("max_new_tokens", 0)  # prompt and continuation share the positions
    return limit


# -- worker side --------------------------------------------------------------------------------
def init_worker(model_dir: str, causal: bool) -> None:
    import torch

    global _TOKENIZER
    torch.set_num_threads(1)
    _TOKENIZER = load_tokenizer(Path(model_dir), causal)


def decode_batch(payload: dict[str, Any]) -> dict[str, Any]:
    texts = _TOKENIZER.batch_decode(payload["ids"], skip_special_tokens=True)
    texts = [t.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\\n") for t in texts]
    return {**payload, "texts": texts, "ids": None}


# -- main ---------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    args = build_parser().parse_args(argv)
    try:
        check_paths(args)
        with mode_block(args.mode):
            return run(args)
    except UsageError as exc:
        return fail(str(exc), code=2)
    except (ResumeError, PipelineError, InvalidInput) as exc:
        return fail(str(exc))


def check_paths(args: argparse.Namespace) -> None:
    """Every path a user typed, checked before the model loads and before anything is written."""
    if not args.model_dir.is_dir():
        raise UsageError(f"model directory {args.model_dir}: no such directory")
    if not (args.model_dir / "config.json").is_file():
        raise UsageError(f"model directory {args.model_dir}: has no config.json (not written by save_pretrained)")
    check_input_file(args.input, "--input")
    if args.reference is not None:
        check_input_file(args.reference, "--reference")
    check_output_file(args.output, "--output")


class InvalidInput(ValueError):
    """Malformed or too long input lines (without --skip-invalid)."""


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoConfig

    global _TOKENIZER
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise UsageError(f"--device {device}: not a device ({exc})") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available here")
    if kind == "cpu":
        heap.keep_freed_memory()  # CPU decode steps free and refault big buffers otherwise (fastgen.cli.heap)
    world = distributed.from_environment(device)
    if world.size > 1 and device.startswith("cuda") and args.device is None:
        device = f"cuda:{world.local_rank}"
        torch.cuda.set_device(world.local_rank)
    if (
        world.size > 1
        and args.resume
        and args.output.exists()
        and not any(journal_exists(p) for p in world.parts(args.output))
    ):
        logger.info("%s is complete; nothing to resume", args.output)
        return 0
    kwargs = generate_kwargs(args)
    try:
        causal = not AutoConfig.from_pretrained(args.model_dir).is_encoder_decoder
    except (OSError, ValueError) as exc:
        raise UsageError(f"model directory {args.model_dir}: cannot load its config: {exc}") from exc
    workers = args.postprocess_workers
    if args.no_pipeline:
        workers = 0
    elif workers is None:
        workers = default_workers(device.startswith("cuda"))
    executor = make_executor(workers, "process", init_worker, (str(args.model_dir), causal))
    try:
        return _run(args, world, device, kwargs, causal, executor)
    except BaseException:
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        raise


def _run(
    args: argparse.Namespace, world: distributed.World, device: str, kwargs: dict, causal: bool, executor: Any
) -> int:
    import torch

    global _TOKENIZER
    try:
        tokenizer = _TOKENIZER = load_tokenizer(args.model_dir, causal)
        model = load_model(args.model_dir, device, args.dtype)
    except (OSError, ValueError) as exc:
        raise UsageError(f"model directory {args.model_dir}: cannot load the model or tokenizer: {exc}") from exc

    lines = read_lines(args.input)
    valid = [line for line in lines if line.text is not None]
    encoded = tokenizer([line.text for line in valid], add_special_tokens=True)["input_ids"] if valid else []
    for line, ids in zip(valid, encoded, strict=True):
        line.ids = ids
    limit = model_input_limit(model, tokenizer, kwargs)
    if args.max_input_tokens and limit and args.max_input_tokens > limit:  # longer lines crash in the model
        raise UsageError(
            f"--max-input-tokens {args.max_input_tokens}: the model takes at most {limit} input tokens "
            f"(its positions{', less the new tokens' if causal else ''}); give {limit} or less"
        )
    limit = args.max_input_tokens or limit
    if limit:
        check_lengths(lines, limit)
    invalid = [line for line in lines if line.text is None]
    if invalid and not args.skip_invalid:
        shown = "\n".join(f"  {args.input}:{line.number} {line.problem}" for line in invalid[:10])
        more = f"\n  ... and {len(invalid) - 10} more" if len(invalid) > 10 else ""
        raise InvalidInput(f"{len(invalid)} invalid input line(s) (use --skip-invalid to skip them):\n{shown}{more}")

    window = args.sort_window or 16 * args.batch_size
    batches = plan(lines, args.batch_size, window)
    header = {
        "tool": "fastgen-generate-hf",
        "model": str(args.model_dir.resolve()),
        "input_sha256": hashlib.sha256(args.input.read_bytes()).hexdigest(),
        "generate": kwargs,
        "batch_size": args.batch_size,
        "window": window,
        "seed": args.seed,
        "dtype": args.dtype,
        "max_input_tokens": limit,
        "skip_invalid": args.skip_invalid,
        "world": world.size,
        "rank": world.rank,
    }
    from fastgen.cli import continuous_hf  # imports Transformers: not at module import (--help stays fast)

    stream = None
    if args.continuous_batching is not False:  # None: the default, chosen per run; True: asked for
        stream = continuous_hf.serves(model, kwargs, args.batch_size, chosen=args.continuous_batching is None)
    if stream is not None and stream.do_sample:  # only sampling seeds differently (per line, not per batch)
        header["continuous_batching"] = True

    journal = Journal(world.part(args.output), header, resume=args.resume)
    done = journal.done_units
    mine = [b for b in batches if b.window % world.size == world.rank and b.window not in done]
    progress = Progress(
        total=sum(len(b.indices) for b in batches if b.window % world.size == world.rank),
        initial=sum(len(b.indices) for b in batches if b.window in done),
        enabled=world.is_main and not args.no_progress_bar,
    )
    pending: dict[int, str] = {}  # input index -> output text, for the window being assembled

    def commit(key: int, result: dict[str, Any]) -> None:
        batch: Batch = batches[key]
        pending.update(zip(batch.indices, result["texts"], strict=True))
        progress.update(len(batch.indices), result["ntokens"])
        if batch.last_in_window:
            start = batch.window * window
            indices = range(start, min(start + window, len(lines)))
            journal.commit(batch.window, "".join(pending.pop(i, "") + "\n" for i in indices))

    def offload(item: tuple[Batch, Any, int]) -> dict[str, Any]:
        _, new_tokens, pad = item
        if new_tokens is None:
            return {"ids": [], "ntokens": 0}
        new_tokens = new_tokens.cpu()
        return {"ids": new_tokens.tolist(), "ntokens": int(new_tokens.ne(pad).sum())}

    pad = tokenizer.pad_token_id
    start_time = time.perf_counter()
    with AsyncPipeline(offload, decode_batch, commit, executor=executor, serial=args.no_pipeline) as pipeline:
        continuous = (
            None
            if stream is None
            else continuous_hf.start(model, lines, mine, kwargs, args.batch_size, stream, args.seed)
        )
        for batch in mine:
            new_tokens = None
            if continuous is not None:
                new_tokens = continuous.next_batch(batch, pad)
            elif batch.indices:
                enc = tokenizer.pad({"input_ids": [lines[i].ids for i in batch.indices]}, return_tensors="pt")
                enc = {k: v.to(device) for k, v in enc.items()}
                if args.seed is not None:
                    torch.manual_seed(args.seed + batch.key)
                with torch.inference_mode():
                    out = _generate(model, enc, kwargs)
                new_tokens = out[:, enc["input_ids"].shape[1] :] if causal else out
            pipeline.submit(batch.key, (batch, new_tokens, pad))
    progress.close()
    journal.close()
    elapsed = time.perf_counter() - start_time

    distributed.barrier(world)
    if world.size > 1:
        if world.is_main:
            parts = world.parts(args.output)
            merge_parts(parts, args.output)
            for part in parts:
                part.unlink()
                part.with_name(part.name + ".fastgen-index").unlink()
        distributed.shutdown(world)
    if not world.is_main:
        return 0
    _summary(lines, invalid, progress, elapsed, world)
    if args.reference is not None:
        _score(args.output, args.reference, lines)
    return 0


def _generate(model: Any, enc: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    """``model.generate``, with its rejection of an argument turned into a one-line error. The journal
    writes nothing before the first window is done, so a bad argument leaves no file behind."""
    try:
        return model.generate(**enc, **kwargs)
    except (ValueError, TypeError) as exc:
        raise rejected(kwargs, exc) from exc


def _summary(
    lines: list[InputLine], invalid: list[InputLine], progress: Progress, elapsed: float, world: distributed.World
) -> None:
    logger.info(
        "%sgenerated %d of %d inputs (%d tokens) in %.1fs: %.2f samples/s, %.1f tokens/s",
        f"rank 0 of {world.size}: " if world.size > 1 else "",
        progress.samples,
        len(lines),
        progress.tokens,
        elapsed,
        progress.samples / max(elapsed, 1e-9),
        progress.tokens / max(elapsed, 1e-9),
    )
    if invalid:
        numbers = ", ".join(str(line.number) for line in invalid[:20])
        logger.warning(
            "skipped %d invalid input line(s): %s%s", len(invalid), numbers, " ..." if len(invalid) > 20 else ""
        )


def _score(output: Path, reference: Path, lines: list[InputLine]) -> None:
    import sacrebleu

    hyps = output.read_text(encoding="utf-8").split("\n")[: len(lines)]
    refs = reference.read_text(encoding="utf-8-sig").splitlines()
    if len(refs) != len(lines):
        raise InvalidInput(f"{reference} has {len(refs)} lines; the input has {len(lines)}")
    keep = [i for i, line in enumerate(lines) if line.text is not None]
    hyps, refs = [hyps[i] for i in keep], [refs[i] for i in keep]
    print(f"BLEU = {sacrebleu.corpus_bleu(hyps, [refs]).score:.2f} ({len(keep)} lines, sacrebleu)")
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        logger.info("ROUGE not computed: pip install rouge-score")
        return
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for hyp, ref in zip(hyps, refs, strict=True):
        for name, score in scorer.score(ref, hyp).items():
            totals[name] += score.fmeasure
    n = max(len(hyps), 1)
    print("ROUGE-1/2/L F1 = " + "/".join(f"{100 * totals[k] / n:.2f}" for k in ("rouge1", "rouge2", "rougeL")))


def cli_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli_main()
