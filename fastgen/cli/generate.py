"""``fastgen-generate``: ``fairseq-generate`` with fastgen's patches and an asynchronous pipeline.

It takes fairseq-generate's arguments (fairseq's own parser, task, checkpoint and batch loading)
and writes the same S-/T-/H-/D-/P- lines and final score line, byte for byte. What differs:
generation runs while earlier batches are moved off the device and post-processed in worker
processes (``fastgen.cli.pipeline``); fairseq's timestamped log lines go to stderr, so the output
holds only results; with ``--results-path``, ``--resume`` continues a killed run, and under
``torchrun`` each rank generates a shard and rank 0 merges the output.

    fastgen-generate DATA --path ckpt.pt --beam 4 --results-path out/ [--resume]
    torchrun --nproc_per_node=2 -m fastgen.cli.generate DATA --path ckpt.pt --results-path out/
"""

from __future__ import annotations

import argparse
import ast
import atexit
import base64
import logging
import os
import pickle
import sys
import tempfile
from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from typing import Any

from fastgen.cli import distributed
from fastgen.cli.common import (
    UsageError,
    add_mode_arg,
    add_pipeline_args,
    allow_full_checkpoint_loading,
    check_output_file,
    default_workers,
    fail,
    mode_block,
    setup_logging,
)
from fastgen.cli.fairseq_post import format_batch, offload_batch, replay_scores, set_state, warm_worker
from fastgen.cli.journal import Journal, ResumeError, merge_parts
from fastgen.cli.journal import exists as journal_exists
from fastgen.cli.pipeline import AsyncPipeline, PipelineError, Progress, make_executor

logger = logging.getLogger("fastgen.cli.generate")


def build_parser() -> argparse.ArgumentParser:
    from fairseq import options

    parser = options.get_generation_parser()
    # fairseq_cli.generate adds this too (for tasks that read model args).
    parser.add_argument("--arch", "-a", metavar="ARCH", default="wav2vec2", help="model architecture")
    group = parser.add_argument_group("fastgen")
    add_mode_arg(group)
    add_pipeline_args(group)
    group.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip inputs longer than the model accepts (fairseq's --skip-invalid-size-inputs-valid-test)",
    )
    group.add_argument(
        "--exact-scores",
        action="store_true",
        help="H-/D-/P- scores byte-identical to fairseq-generate's: turn off fastgen's beam-shared "
        "cross-attention (dedup), whose grouped query-key product rounds differently in the last digits "
        "(tokens are identical either way; see docs/guides/cli.md)",
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from fairseq import options

    args = options.parse_args_and_arch(build_parser(), list(argv) if argv is not None else None)
    if args.skip_invalid:
        args.skip_invalid_size_inputs_valid_test = True
    return args


# fairseq is not a dependency of the wheel (ve-fairseq must go in with --no-deps, see scripts/setup.sh).
INSTALL_FAIRSEQ = "pip install 'fastgen-seq[fairseq]' && pip install --no-deps ve-fairseq==0.12.3"


def _fairseq_missing() -> str | None:
    """One line saying what to install when fairseq (or one of its imports) is missing, else None.

    Checked before argparse runs, so even ``--help`` ends in that line instead of a traceback.
    """
    try:
        import fairseq  # noqa: F401
    except ModuleNotFoundError as exc:
        return f"fastgen-generate needs fairseq (no module named {exc.name!r}); install it with: {INSTALL_FAIRSEQ}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    missing = _fairseq_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    setup_logging()
    allow_full_checkpoint_loading()
    # Start the worker processes first: their `import fairseq` then overlaps the main process's.
    early = argparse.ArgumentParser(add_help=False)
    add_pipeline_args(early)
    early.add_argument("--cpu", action="store_true")
    executor = _start_workers(early.parse_known_args(argv)[0])
    args = parse_args(argv)
    try:
        with mode_block(args.mode, without=["dedup"] if args.exact_scores else []):
            return run(args, list(argv) if argv is not None else sys.argv[1:], executor)
    except UsageError as exc:
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        return fail(str(exc), code=2)
    except (ResumeError, PipelineError) as exc:
        return fail(str(exc))
    except BaseException as exc:
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        if type(exc).__name__ == "UnpicklingError":
            return fail(
                f"cannot load the checkpoint: {exc}\nfairseq checkpoints pickle Python objects; "
                "unset TORCH_FORCE_WEIGHTS_ONLY_LOAD to let fastgen-generate load them (trusted files only)"
            )
        raise


def _check(cfg: Any) -> None:
    """fairseq_cli.generate's own checks, and fastgen's of the paths, before anything loads or is written."""
    if cfg.common_eval.path is None:
        raise UsageError("--path required for generation")
    if cfg.generation.beam < 1:
        raise UsageError(f"--beam must be a positive integer, got {cfg.generation.beam}")
    if cfg.generation.sampling and cfg.generation.nbest != cfg.generation.beam:
        raise UsageError("--sampling requires --nbest to be equal to --beam")
    if cfg.generation.replace_unk is not None and cfg.dataset.dataset_impl != "raw":
        raise UsageError("--replace-unk requires a raw text dataset (--dataset-impl=raw)")
    plain = "://" not in cfg.common_eval.path and not cfg.checkpoint.checkpoint_suffix
    for path in cfg.common_eval.path.split(os.pathsep) if plain and cfg.checkpoint.checkpoint_shard_count == 1 else []:
        if not Path(path).is_file():
            raise UsageError(f"--path {path}: {'not a regular file' if Path(path).exists() else 'no such file'}")
    data = getattr(cfg.task, "data", None)
    for path in data.split(os.pathsep) if isinstance(data, str) and data and "://" not in data else []:
        if not Path(path).exists():
            raise UsageError(f"data directory {path}: no such file or directory")
    output = _output_path(cfg)
    if output is not None:
        check_output_file(output, "--results-path")


def run(args: argparse.Namespace, argv: list[str], executor: Any = None) -> int:
    import numpy as np
    import torch
    from fairseq import checkpoint_utils, scoring, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    cfg = convert_namespace_to_omegaconf(args)
    _check(cfg)
    utils.import_user_module(cfg.common)
    if cfg.dataset.max_tokens is None and cfg.dataset.batch_size is None:
        cfg.dataset.max_tokens = 12000

    use_cuda = torch.cuda.is_available() and not cfg.common.cpu
    world = distributed.from_environment("cuda" if use_cuda else "cpu")
    if use_cuda and world.size > 1:
        torch.cuda.set_device(world.local_rank)
    output = _output_path(cfg)
    if (args.resume or world.size > 1) and output is None:
        raise UsageError("--resume and torchrun runs need --results-path (an output file)")
    if world.size > 1 and args.resume and output.exists() and not any(journal_exists(p) for p in world.parts(output)):
        if world.is_main:
            logger.info("%s is complete; nothing to resume", output)
        return 0

    # The order of these calls is fairseq_cli.generate's: the random state at the first batch
    # (sampling) depends on it.
    if cfg.common.seed is not None and not cfg.generation.no_seed_provided:
        np.random.seed(cfg.common.seed)
        utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    try:
        src_dict = getattr(task, "source_dictionary", None)
    except NotImplementedError:
        src_dict = None
    tgt_dict = task.target_dictionary
    overrides = ast.literal_eval(cfg.common_eval.model_overrides)
    logger.info("loading model(s) from %s", cfg.common_eval.path)
    models, saved_cfg = checkpoint_utils.load_model_ensemble(
        utils.split_paths(cfg.common_eval.path),
        arg_overrides=overrides,
        task=task,
        suffix=cfg.checkpoint.checkpoint_suffix,
        strict=(cfg.checkpoint.checkpoint_shard_count == 1),
        num_shards=cfg.checkpoint.checkpoint_shard_count,
    )
    task.load_dataset(cfg.dataset.gen_subset, task_cfg=saved_cfg.task)
    lms: list[Any] = [None]
    if cfg.generation.lm_path is not None:
        overrides["data"] = cfg.task.data
        lms, _ = checkpoint_utils.load_model_ensemble([cfg.generation.lm_path], arg_overrides=overrides, task=None)
    for model in chain(models, lms):
        if model is None:
            continue
        if cfg.common.fp16:
            model.half()
        if use_cuda and not cfg.distributed_training.pipeline_model_parallel:
            model.cuda()
        model.prepare_for_inference_(cfg)
    align_dict = utils.load_align_dict(cfg.generation.replace_unk)

    epoch_itr = task.get_batch_iterator(
        dataset=task.dataset(cfg.dataset.gen_subset),
        max_tokens=cfg.dataset.max_tokens,
        max_sentences=cfg.dataset.batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), *[m.max_positions() for m in models]),
        ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
        required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
        seed=cfg.common.seed,
        num_shards=world.size,
        shard_id=world.rank,
        num_workers=cfg.dataset.num_workers,
        data_buffer_size=cfg.dataset.data_buffer_size,
    )
    if getattr(epoch_itr, "persistent_workers", False):
        # One pass over the data: fairseq's default keeps the data-loader workers alive for another epoch, and
        # they outlived the call (a second call in the same process then waited ~5 s for them to go).
        epoch_itr.persistent_workers = False
    batches = list(epoch_itr.frozen_batches)
    itr = epoch_itr.next_epoch_itr(shuffle=False)
    generator = task.build_generator(
        models, cfg.generation, extra_gen_cls_kwargs={"lm_model": lms[0], "lm_weight": cfg.generation.lm_weight}
    )
    if hasattr(generator, "symbols_to_strip_from_output"):
        strip = generator.symbols_to_strip_from_output
    else:
        strip = {generator.eos}
    tokenizer = task.build_tokenizer(cfg.tokenizer)
    bpe = task.build_bpe(cfg.bpe)
    state = {
        "src_dict": src_dict,
        "tgt_dict": tgt_dict,
        "bpe": bpe,
        "tokenizer": tokenizer,
        "align_dict": align_dict,
        "post_process": cfg.common_eval.post_process,
        "symbols_to_strip": strip,
        "quiet": cfg.common_eval.quiet,
        "print_alignment": cfg.generation.print_alignment,
        "print_step": cfg.generation.print_step,
        "retain_iter_history": cfg.generation.retain_iter_history,
    }
    set_state(state)
    state_file = _share_state(state, executor)
    if state_file is None and executor is not None:
        executor.shutdown(wait=False, cancel_futures=True)
        executor = make_executor(_worker_count(args), "thread")
    dataset = task.dataset(cfg.dataset.gen_subset)
    ctx = {
        "nbest": cfg.generation.nbest,
        "pad": tgt_dict.pad(),
        "print_step": cfg.generation.print_step,
        "retain_iter_history": cfg.generation.retain_iter_history,
        "original_text": (
            (lambda i: (dataset.src.get_original_text(i), dataset.tgt.get_original_text(i)))
            if align_dict is not None
            else None
        ),
    }
    random_decoding = bool(cfg.generation.sampling or cfg.generation.retain_dropout)

    header = {"tool": "fastgen-generate", "argv": _fingerprint(argv), "world": world.size, "rank": world.rank}
    journal = Journal(world.part(output), header, resume=args.resume) if output is not None else None
    done = journal.done_units if journal is not None else set()
    # Restored just before the first generation: starting the batch iterator draws from torch's
    # generator too (DataLoader seeds), as it did before the first batch of the killed run.
    pending_rng = journal.records[-1]["rng"] if journal is not None and journal.records and random_decoding else None
    my_batches = batches[world.rank :: world.size]
    progress = Progress(
        total=sum(len(b) for b in my_batches),
        initial=sum(len(batches[u]) for u in done if u < len(batches)),
        enabled=world.is_main and not cfg.common.no_progress_bar,
    )
    score_items: list[dict[str, Any]] = []

    def commit(unit: int, result: dict[str, Any]) -> None:
        if journal is not None:
            extra = {"score": result["scores"], "n": result["nsentences"], "ntok": result["ntokens"]}
            if result["meta"] is not None:
                extra["rng"] = result["meta"]
            journal.commit(unit, result["text"], **extra)
        else:
            score_items.extend(result["scores"])
            sys.stdout.write(result["text"])
            sys.stdout.flush()
        progress.update(result["nsentences"], result["ntokens"])

    def offload(item: tuple[Any, Any, Any]) -> dict[str, Any]:
        sample, hypos, rng = item
        payload = offload_batch(sample, hypos, ctx)
        payload["meta"] = rng
        payload["state_file"] = state_file
        return payload

    pipeline = AsyncPipeline(offload, format_batch, commit, executor=executor, serial=args.no_pipeline)
    with pipeline:
        for step, sample in enumerate(itr):
            unit = step * world.size + world.rank
            if unit in done or "net_input" not in sample:
                continue
            sample = utils.move_to_cuda(sample) if use_cuda else sample
            if pending_rng is not None:
                _restore_rng(pending_rng)
                pending_rng = None
            prefix_tokens = None
            if cfg.generation.prefix_size > 0:
                prefix_tokens = sample["target"][:, : cfg.generation.prefix_size]
            hypos = task.inference_step(
                generator, models, sample, prefix_tokens=prefix_tokens, constraints=sample.get("constraints")
            )
            pipeline.submit(unit, (sample, hypos, _rng_state(use_cuda) if random_decoding else None))
    progress.close()

    scorer = scoring.build_scorer(cfg.scoring, tgt_dict)
    reencode = align_dict is not None or cfg.common_eval.post_process is not None
    if journal is not None and world.size > 1:
        journal.close()
    if not world.is_main:
        distributed.barrier(world)
        distributed.shutdown(world)
        return 0
    distributed.barrier(world)
    if output is not None:
        score_items = _scores_in_order(world.parts(output) if world.size > 1 else [journal.work])
    has_target = replay_scores(scorer, tgt_dict, score_items, reencode)
    trailer = ""
    if has_target:
        _warn_bleu(cfg)
        trailer = f"Generate {cfg.dataset.gen_subset} with beam={cfg.generation.beam}: {scorer.result_string()}\n"
    logger.info("NOTE: hypothesis and token scores are output in base 2")
    logger.info(
        "Translated %d sentences (%d tokens) in %.1fs (%.2f sentences/s, %.2f tokens/s)",
        progress.samples,
        progress.tokens,
        progress.elapsed,
        progress.samples / max(progress.elapsed, 1e-9),
        progress.tokens / max(progress.elapsed, 1e-9),
    )
    if output is None:
        sys.stdout.write(trailer)
        sys.stdout.flush()
    elif world.size > 1:
        parts = world.parts(output)
        merge_parts(parts, output, trailer)
        for part in parts:
            part.unlink()
            part.with_name(part.name + ".fastgen-index").unlink()
    else:
        journal.finish(trailer)
    distributed.shutdown(world)
    return 0


def _scores_in_order(parts: list[Path]) -> list[dict[str, Any]]:
    from fastgen.cli.journal import index_path, read_index

    records = []
    for part in parts:
        records.extend(r for r in read_index(index_path(part))[1] if "unit" in r)
    records.sort(key=lambda r: r["unit"])
    return [item for record in records for item in record["score"]]


def _output_path(cfg: Any) -> Path | None:
    if cfg.common_eval.results_path is None:
        return None
    return Path(cfg.common_eval.results_path) / f"generate-{cfg.dataset.gen_subset}.txt"


def _start_workers(args: argparse.Namespace) -> Any:
    """The post-processing pool, started before the model loads so worker start-up overlaps it."""
    workers = _worker_count(args)
    return make_executor(workers, "process", warm_worker) if workers else None


def _worker_count(args: argparse.Namespace) -> int:
    if args.no_pipeline:
        return 0
    if args.postprocess_workers is not None:
        return args.postprocess_workers
    import torch

    return default_workers(torch.cuda.is_available() and not args.cpu)


def _share_state(state: dict[str, Any], executor: Any) -> str | None:
    """Pickle the post-processing state to a file the worker processes read once; None if it
    cannot be pickled (then threads share the objects: correct, but GIL-bound)."""
    if executor is None:
        return None
    try:
        data = pickle.dumps(state)
    except Exception as exc:
        logger.warning("post-processing in threads (GIL-bound): its state cannot be pickled (%s)", exc)
        return None
    handle = tempfile.NamedTemporaryFile(prefix="fastgen-post-", suffix=".pkl", delete=False)  # noqa: SIM115
    with handle:
        handle.write(data)
    atexit.register(os.unlink, handle.name)
    return handle.name


def _rng_state(use_cuda: bool) -> str:
    import torch

    states = {"cpu": torch.get_rng_state()}
    if use_cuda:
        states["cuda"] = torch.cuda.get_rng_state()
    return base64.b64encode(pickle.dumps({k: v.numpy().tobytes() for k, v in states.items()})).decode()


def _restore_rng(encoded: str) -> None:
    import torch

    states = pickle.loads(base64.b64decode(encoded))
    torch.set_rng_state(torch.frombuffer(bytearray(states["cpu"]), dtype=torch.uint8))
    if "cuda" in states:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(states["cuda"]), dtype=torch.uint8))


def _fingerprint(argv: list[str]) -> list[str]:
    """The arguments that decide the output (not --resume, workers, progress)."""
    ignored = {"--resume", "--no-pipeline", "--no-progress-bar"}
    out: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        if arg in ignored:
            continue
        if arg == "--postprocess-workers":
            skip_next = True
            continue
        if arg.startswith("--postprocess-workers="):
            continue
        out.append(arg)
    return out


def _warn_bleu(cfg: Any) -> None:
    if cfg.bpe and not cfg.generation.sacrebleu:
        if cfg.common_eval.post_process:
            logger.warning(
                "BLEU score is being computed by splitting detokenized string on spaces, this is probably not "
                "what you want. Use --sacrebleu for standard 13a BLEU tokenization"
            )
        else:
            logger.warning(
                "If you are using BPE on the target side, the BLEU score is computed on BPE tokens, not on "
                "proper words.  Use --sacrebleu for standard 13a BLEU tokenization"
            )


def cli_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli_main()
