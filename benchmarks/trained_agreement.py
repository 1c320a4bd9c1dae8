"""Every CPU mode on the trained model: token agreement with upstream fp32, BLEU/chrF, time.

    OMP_NUM_THREADS=1 python -m benchmarks.trained_agreement [--model-dir ~/.cache/fastgen/trained-bart-restore]
        [--modes beam4,greedy] [--threads 1] [--rounds 3] [--batch-size 16] [--candidates a,b,...]
        [--sensitivity N] [--sentences N] [--out FILE.json]

The model, its test set and its CTranslate2 conversion are those ``benchmarks.train_small_model``
wrote; its held-out cross-entropy and predictive entropy (masked and copied tokens apart) are recorded
with the results. Candidates decode the same test batches with the same settings
(``train_small_model.GENERATE``, natural end at ``</s>``): upstream Transformers (``fastgen.unpatched()``,
the reference), fastgen's default (exact) features, the same with upstream's forward at every step
(``fastgen_exact_upstream_step``: ``FASTGEN_LEAN_STEP=0``, what the lean decode step saves), the exact and
int8 modes with the lean step in Python (``*_python_step``: ``FASTGEN_COMPILED_STEP=0``, what the compiled
step saves), fastgen + ``fast_gemm``, fastgen + ``int8`` where fastgen knows that feature, and CTranslate2
float32 and int8_float32 on the converted model.

Per candidate: the share of sentences whose generated ids equal upstream's, the share of positions that
agree (over the longer of the two), BLEU and chrF (sacrebleu) against the references (the copy baseline's
beside them), and the median wall and process CPU time of decoding the whole test set
(``benchmarks.measure.alternate``: a warm-up pass, then rounds in rotating order; the load average is
recorded). The int8 candidates are also compared with their own fp32 engine, which separates
quantization from the differences between two beam searches (CTranslate2's early exit and length
normalization are its own; its ``min_decoding_length`` is set to 0, Transformers' default, where its own
default 1 forbids an immediate ``</s>``).

fastgen's int8 and CTranslate2's int8 are compared sentence by sentence (equal to upstream or not) with
McNemar's exact test: of the sentences where exactly one of the two equals upstream, how likely a split at
least this uneven is if both were equally good (two-sided binomial, p = 0.5).

``--sensitivity N``: on N evenly spaced test sentences, int8 with one group of linears kept in fp32 at a
time (each layer; each kind of linear across the layers; the LM head), beam 4: the rows that then equal
upstream say which products lose agreement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers

import fastgen
from benchmarks import train_small_model as trained
from benchmarks.measure import alternate, environment, result_header, write_result
from fastgen.ops import int8_linear

#: fastgen.optimizer.transformers.beam_search.LEAN_ENV (importing that module here, before Transformers'
#: generation module, would run the patches' import hooks while it is half imported)
LEAN_ENV = "FASTGEN_LEAN_STEP"
COMPILED_ENV = "FASTGEN_COMPILED_STEP"  # fastgen.models.compiled_step.ENV

MODES = {"beam4": 4, "greedy": 1}
DEFAULT = sorted(set(fastgen.known_features()) - fastgen.optimizer.registry.OPT_IN_FEATURES)
# The engine each candidate is quantized from: its agreement with that engine isolates the quantization.
FP32_OF = {
    "fastgen_int8": "upstream",
    "fastgen_int8_python_step": "upstream",
    "fastgen_int8_symmetric": "upstream",
    "ctranslate2_int8_float32": "ctranslate2_float32",
}
#: the pairs McNemar's test compares (rows equal to upstream)
PAIRS = [
    ("fastgen_int8", "ctranslate2_int8_float32"),
    ("fastgen_int8_symmetric", "ctranslate2_int8_float32"),
    ("fastgen_int8", "fastgen_int8_symmetric"),
]


def hf_features() -> dict[str, list[str] | None]:
    """Transformers candidates by name: the features each runs with (None: upstream)."""
    candidates: dict[str, list[str] | None] = {
        "upstream": None,
        "fastgen_exact": DEFAULT,
        "fastgen_exact_upstream_step": DEFAULT,
        "fastgen_exact_python_step": DEFAULT,
        "fastgen_fast": [*DEFAULT, "fast_gemm"],
    }
    if "int8" in fastgen.known_features():
        candidates["fastgen_int8"] = [*DEFAULT, "int8"]
        candidates["fastgen_int8_python_step"] = [*DEFAULT, "int8"]
        if hasattr(int8_linear, "GRID"):  # the earlier, symmetric activation grid (CTranslate2's)
            candidates["fastgen_int8_symmetric"] = [*DEFAULT, "int8"]
    return candidates


@contextmanager
def decode_step(name: str) -> Iterator[None]:
    """``*_upstream_step`` candidates: fastgen with upstream's forward at every step (no lean decode step);
    ``*_python_step``: the lean step in Python (not the compiled one)."""
    switch = {"_upstream_step": LEAN_ENV, "_python_step": COMPILED_ENV}
    env = next((env for suffix, env in switch.items() if name.endswith(suffix)), None)
    if env is None:
        yield
        return
    previous = os.environ.get(env)
    os.environ[env] = "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = previous


@contextmanager
def grid(name: str) -> Iterator[None]:
    """int8's activation grid for a candidate: ``..._symmetric`` ones run the symmetric grid."""
    if not hasattr(int8_linear, "GRID"):
        yield
        return
    before = int8_linear.GRID
    int8_linear.GRID = "symmetric" if name.endswith("_symmetric") else "asymmetric"
    try:
        yield
    finally:
        int8_linear.GRID = before


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Sentences with identical ids, and positions that agree over the longer of each pair."""
    same_rows = sum(a == b for a, b in zip(reference, other, strict=True))
    same = sum(sum(x == y for x, y in zip(a, b, strict=False)) for a, b in zip(reference, other, strict=True))
    total = sum(max(len(a), len(b)) for a, b in zip(reference, other, strict=True))
    return {"sequence_match": same_rows / len(reference), "token_agreement": same / total if total else 1.0}


def mcnemar_exact(first: list[bool], second: list[bool]) -> dict[str, float]:
    """McNemar's exact test on paired outcomes: ``b`` only the first true, ``c`` only the second; the
    two-sided p of a split at least as uneven under Binomial(b + c, 1/2)."""
    b = sum(x and not y for x, y in zip(first, second, strict=True))
    c = sum(y and not x for x, y in zip(first, second, strict=True))
    n = b + c
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n if n else 1.0
    return {"only_first": b, "only_second": c, "p_value": min(1.0, 2 * tail)}


def linear_groups(model: Any) -> dict[str, list[str]]:
    """Names of the model's linears by layer and by kind (what --sensitivity keeps in fp32, one group at a time)."""
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        if "layers" in parts:
            at = parts.index("layers")
            groups.setdefault(".".join(parts[at - 1 : at + 2]), []).append(name)  # encoder.layers.0
            side = parts[at - 1]
            kind = ".".join(parts[at + 2 :])  # self_attn.q_proj, fc2, ...
            if kind.endswith(("q_proj", "k_proj", "v_proj")):
                kind = kind.rsplit(".", 1)[0] + ".qkv"
            groups.setdefault(f"{side} {kind}", []).append(name)
        else:
            groups.setdefault(name, []).append(name)  # lm_head
    return groups


def kept_fp32(model: Any, names: list[str]) -> Any:
    """Context: the named linears run upstream's forward inside an int8 scope (an instance ``forward`` makes
    the mode leave a module alone)."""
    from contextlib import contextmanager

    modules = dict(model.named_modules())

    @contextmanager
    def scope() -> Any:
        for name in names:
            modules[name].forward = types.MethodType(type(modules[name]).forward, modules[name])
        try:
            yield
        finally:
            for name in names:
                del modules[name].forward

    return scope()


def _summary(name: str, r: dict[str, Any]) -> str:
    """One line per candidate for the log."""
    same = r["vs_upstream"]
    return (
        f"{name} {r['median_wall_seconds'] or 0:.2f}s BLEU {r['bleu']:.1f} chrF {r['chrf']:.1f} rows "
        f"{100 * same['sequence_match']:.1f}% tokens {100 * same['token_agreement']:.1f}%"
    )


def _cut(ids: list[int]) -> list[int]:
    return ids[: ids.index(trained.EOS)] if trained.EOS in ids else ids


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=trained.DEFAULT_OUT)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up (0: agreement only)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--candidates", default="", help="comma-separated subset of the candidates (default: all)")
    parser.add_argument("--sensitivity", type=int, default=0, help="sentences for the per-group fp32 runs (0: none)")
    parser.add_argument("--sensitivity-grids", default="fastgen_int8_symmetric,fastgen_int8")
    parser.add_argument("--sentences", type=int, default=0, help="the first N test sentences only (0: all)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import tokenizers

    model = transformers.BartForConditionalGeneration.from_pretrained(args.model_dir / "hf").eval()
    tokenizer = tokenizers.Tokenizer.from_file(str(args.model_dir / "hf" / "tokenizer.json"))
    test = trained.load_test(args.model_dir)
    if args.sentences:
        test = test[: args.sentences]
    references = [row["target"] for row in test]
    groups = [test[b : b + args.batch_size] for b in range(0, len(test), args.batch_size)]
    hf_batches = [trained.source_batch([row["source_ids"] for row in group]) for group in groups]

    try:
        import ctranslate2

        from benchmarks.ctranslate2_compare import _StandInTokenizer
    except ImportError:
        ctranslate2 = None
        sys.stdout.write("ctranslate2 is not installed: measuring the Transformers candidates only\n")
    translators: dict[str, Any] = {}
    if ctranslate2 is not None:
        names = _StandInTokenizer(model.config).names  # the token names convert() gave the CTranslate2 vocabulary
        ids_of = {name: i for i, name in names.items()}
        ct2_sources = [[[names[i] for i in row["source_ids"]] for row in group] for group in groups]
        for compute_type in ("float32", "int8_float32"):
            translators[f"ctranslate2_{compute_type}"] = ctranslate2.Translator(
                str(args.model_dir / "ct2"), device="cpu", compute_type=compute_type, inter_threads=1,
                intra_threads=args.threads,
            )  # fmt: skip

    results: dict[str, Any] = {}
    for mode in filter(None, args.modes.split(",")):
        num_beams = MODES[mode]

        def hf(name: str, features: list[str] | None, num_beams: int = num_beams) -> Callable[[], list[list[int]]]:
            def decode() -> list[list[int]]:
                scope = fastgen.unpatched() if features is None else fastgen.patched(features)
                out = []
                with scope, grid(name), decode_step(name), torch.inference_mode():
                    for batch in hf_batches:
                        ids = model.generate(**batch, num_beams=num_beams, **trained.GENERATE)
                        out += [_cut(row[1:]) for row in ids.tolist()]  # without the decoder start token
                return out

            return decode

        def ct2(translator: Any, num_beams: int = num_beams) -> Callable[[], list[list[int]]]:
            def decode() -> list[list[int]]:
                out = []
                for source in ct2_sources:
                    for result in translator.translate_batch(
                        source, beam_size=num_beams, length_penalty=trained.GENERATE["length_penalty"],
                        min_decoding_length=0, max_decoding_length=trained.GENERATE["max_new_tokens"],
                        return_scores=False,
                    ):  # fmt: skip
                        out.append(_cut([ids_of[token] for token in result.hypotheses[0]]))
                return out

            return decode

        candidates = {name: hf(name, features) for name, features in hf_features().items()}
        candidates |= {name: ct2(translator) for name, translator in translators.items()}
        if args.candidates:
            wanted = {"upstream", *args.candidates.split(",")}
            candidates = {name: run for name, run in candidates.items() if name in wanted}
        first: dict[str, list[list[int]]] = {}
        stable = dict.fromkeys(candidates, True)

        def run(
            name: str, candidates: dict[str, Callable] = candidates, first: dict = first, stable: dict = stable
        ) -> tuple[list[list[int]], float, float]:
            start, start_cpu = time.perf_counter(), time.process_time()
            ids = candidates[name]()
            wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            stable[name] &= first.setdefault(name, ids) == ids
            return ids, wall, cpu

        rounds = alternate(run, list(candidates), args.rounds)  # the warm-up call runs gemm's calibration
        outputs = rounds.outputs
        entry: dict[str, Any] = {"num_beams": num_beams, "load_average": rounds.load_average, "candidates": {}}
        for name, ids in outputs.items():
            wall, cpu = rounds.column(name, 0), rounds.column(name, 1)
            hypotheses = [trained.decode(tokenizer, row) for row in ids]
            row: dict[str, Any] = {
                "vs_upstream": agreement(outputs["upstream"], ids),
                **trained.quality(hypotheses, references),
                "median_wall_seconds": statistics.median(wall) if wall else None,  # --rounds 0: not timed
                "median_cpu_seconds": statistics.median(cpu) if cpu else None,
                "wall_seconds": wall,
                "generated_tokens": sum(len(r) for r in ids),
                "same_output_every_round": stable[name],
            }
            if name in FP32_OF and FP32_OF[name] in outputs:
                row[f"vs_{FP32_OF[name]}"] = agreement(outputs[FP32_OF[name]], ids)
            entry["candidates"][name] = row
        equal = {name: [a == b for a, b in zip(outputs["upstream"], ids, strict=True)] for name, ids in outputs.items()}
        entry["paired_tests_rows_equal_to_upstream"] = [
            {"first": first, "second": second, **mcnemar_exact(equal[first], equal[second])}
            for first, second in PAIRS
            if {first, second} <= equal.keys()
        ]
        for test_result in entry["paired_tests_rows_equal_to_upstream"]:
            sys.stdout.write(f"{mode} paired: {test_result}\n")
        entry["copy_baseline"] = trained.quality([row["copy"] for row in test], references)
        results[mode] = entry
        sys.stdout.write(f"{mode}: " + "; ".join(_summary(n, r) for n, r in entry["candidates"].items()))
        sys.stdout.write(f"; load {rounds.load_average}\n")
        sys.stdout.flush()

    per_group = None
    if args.sensitivity and "int8" in fastgen.known_features():
        grids = [g for g in ("fastgen_int8_symmetric", "fastgen_int8") if g in args.sensitivity_grids.split(",")]
        per_group = sensitivity(model, test, args.sensitivity, args.batch_size, grids)

    training = json.loads((args.model_dir / "training.json").read_text())
    with fastgen.unpatched():
        held_out = trained.held_out_scores(model, test)
    env = environment("cpu")
    report = {
        **result_header("trained_agreement", argv),
        "model": {
            "training_command": training["command"],
            "settings": training["settings"],
            "corpus": training["corpus"],
            "parameters": training["parameters"],
            "held_out": training["held_out"],
            "held_out_here": held_out,  # recomputed from the saved model: masked and copied tokens apart
        },
        "test_sentences": len(test),
        "batch_size": args.batch_size,
        "generate": trained.GENERATE,
        "threads": args.threads,
        "int8_feature": "int8" in fastgen.known_features(),
        "ctranslate2": getattr(ctranslate2, "__version__", None),
        "environment": env,
        "modes": results,
        **({"sensitivity": per_group} if per_group else {}),
    }
    out = args.out or (
        Path(__file__).resolve().parent / "results" / f"trained_agreement-{env['cpu_kind']}-{args.threads}t.json"
    )
    write_result(out, report)
    return report


def sensitivity(
    model: Any, test: list[dict[str, Any]], sentences: int, batch_size: int, grids: list[str]
) -> dict[str, Any]:
    """Beam-4 rows equal to upstream on ``sentences`` evenly spaced test sentences: int8 everywhere, and
    int8 with each group of :func:`linear_groups` kept in fp32, for each of ``grids`` (candidate names)."""
    step = max(1, len(test) // sentences)
    subset = test[::step][:sentences]
    batches = [
        trained.source_batch([row["source_ids"] for row in subset[b : b + batch_size]])
        for b in range(0, len(subset), batch_size)
    ]

    def decode(features: list[str] | None) -> list[list[int]]:
        out = []
        with fastgen.unpatched() if features is None else fastgen.patched(features), torch.inference_mode():
            for batch in batches:
                ids = model.generate(**batch, num_beams=4, **trained.GENERATE)
                out += [_cut(row[1:]) for row in ids.tolist()]
        return out

    upstream = decode(None)
    int8 = [*DEFAULT, "int8"]
    result: dict[str, Any] = {"sentences": len(subset), "num_beams": 4}
    for name in grids:
        with grid(name):
            rows = {"none (all int8)": agreement(upstream, decode(int8))["sequence_match"]}
            for group, names in linear_groups(model).items():
                with kept_fp32(model, names):
                    rows[group] = agreement(upstream, decode(int8))["sequence_match"]
                sys.stdout.write(f"sensitivity {name}: {group} in fp32: rows {100 * rows[group]:.1f}%\n")
                sys.stdout.flush()
        result[f"{name}: rows_equal_to_upstream_with_group_in_fp32"] = rows
    return result


if __name__ == "__main__":
    main()
