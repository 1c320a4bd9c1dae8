"""Upstream Transformers vs fastgen (exact, fast fp32, int8) vs CTranslate2 fp32 and int8 on CPU, one process.

    OMP_NUM_THREADS=1 python -m benchmarks.ctranslate2_compare --scenario bart-base [--threads 1]
        [--modes beam4-norepeat3,beam4,greedy-norepeat3,greedy] [--rounds 3] [--out FILE.json]

The model is the scenario's random-weight model (benchmarks.scenarios), saved with
``save_pretrained`` and converted by CTranslate2's own ``TransformersConverter`` (fp32; its int8
candidate loads the same directory with ``compute_type="int8_float32"``); a
stand-in tokenizer supplies token names ``t<id>`` for the ids, since a random model has none.
Every candidate decodes the same ids with the same length forced (``min == max`` new tokens), so
the work is equal; CTranslate2's Marian conversion drops the ``<pad>`` row of the vocabulary (the
decoder starts from a zero embedding instead), so it projects onto one token fewer.

CTranslate2 is an optional benchmark dependency (``pip install ctranslate2``); without it the
script measures the Transformers candidates only. Candidates alternate in a rotating order after a
warm-up (the warm-up also runs gemm's calibration, whose time is reported separately); wall-clock
medians, this thread's CPU time for the Python candidates, and the 1-minute load average are
recorded. On a shared machine, compare only ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fastgen
from benchmarks.measure import cpu_isa, environment, rotating_order
from benchmarks.scenarios import SCENARIOS
from fastgen.ops import cpu_kernels, linear
from fastgen.optimizer import linear_modes
from fastgen.optimizer.linear_modes import int8_linears, packed_linears

MODES: dict[str, dict[str, Any]] = {
    "beam4-norepeat3": dict(num_beams=4, no_repeat_ngram_size=3),
    "beam4": dict(num_beams=4),
    "greedy-norepeat3": dict(num_beams=1, no_repeat_ngram_size=3),
    "greedy": dict(num_beams=1),
}
ALL_BUT_GEMM = sorted(set(fastgen.known_features()) - fastgen.optimizer.registry.OPT_IN_FEATURES - {"gemm"})
DEFAULT = sorted(set(fastgen.known_features()) - fastgen.optimizer.registry.OPT_IN_FEATURES)
FAST = [*DEFAULT, "fast_gemm"]
INT8 = [*DEFAULT, "int8"]


class _StandInTokenizer:
    """What CTranslate2's converter reads from a tokenizer: token names for ids, special tokens."""

    def __init__(self, config: Any) -> None:
        self.names = {i: f"t{i}" for i in range(config.vocab_size)}
        special = {"bos_token_id": "<s>", "pad_token_id": "<pad>", "eos_token_id": "</s>"}
        for attr, name in special.items():
            if getattr(config, attr, None) is not None:
                self.names[getattr(config, attr)] = name
        unk = min(i for i in range(config.vocab_size) if self.names[i].startswith("t"))
        self.names[unk] = self.unk_token = "<unk>"  # the scenarios' inputs start above the special ids
        self.bos_token = self.names.get(getattr(config, "bos_token_id", None), "<s>")
        self.eos_token = self.names[config.eos_token_id]

    def get_vocab(self) -> dict[str, int]:
        return {name: i for i, name in self.names.items()}

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        return self.names[ids] if isinstance(ids, int) else [self.names[i] for i in ids]


def convert(model: Any, workdir: Path) -> Path:
    """The model as a CTranslate2 fp32 directory (converted once per working directory)."""
    import ctranslate2.converters

    out = workdir / "ct2"
    if (out / "model.bin").exists():
        return out
    hf_dir = workdir / "hf"
    model.save_pretrained(hf_dir)
    tokenizer = _StandInTokenizer(model.config)

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_model(self, model_class: Any, model_name_or_path: str, **kwargs: Any) -> Any:
            loaded = super().load_model(model_class, model_name_or_path, **kwargs)
            # Transformers 5 dropped BART's ``normalize_before`` (always post-norm); the converter reads it.
            if not hasattr(loaded.config, "normalize_before"):
                loaded.config.normalize_before = False
            return loaded

        def load_tokenizer(self, tokenizer_class: Any, model_name_or_path: str, **kwargs: Any) -> Any:
            return tokenizer

    Converter(str(hf_dir)).convert(str(out), force=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="bart-base", choices=["bart-base", "marian"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "fastgen-ct2")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    scenario = SCENARIOS[args.scenario]
    settings = scenario.settings("cpu")
    model, inputs, base_kwargs = scenario.build("cpu", torch.float32, settings)
    base_kwargs = {k: v for k, v in base_kwargs.items() if k not in ("num_beams", "no_repeat_ngram_size")}
    base_kwargs["return_dict_in_generate"] = False
    n = settings["new_tokens"]

    try:
        import ctranslate2
    except ImportError:
        ctranslate2 = None
        sys.stdout.write("ctranslate2 is not installed: measuring the Transformers candidates only\n")
    translator = None
    if ctranslate2 is not None:
        workdir = args.workdir / args.scenario
        workdir.mkdir(parents=True, exist_ok=True)
        translators = {
            compute: ctranslate2.Translator(
                str(convert(model, workdir)), device="cpu", compute_type=compute, inter_threads=1,
                intra_threads=args.threads,
            )
            for compute in ("float32", "int8_float32")
        }  # fmt: skip
        translator = translators["float32"]
    names = _StandInTokenizer(model.config).names
    source = [
        [names[i] for i in row[mask.bool()].tolist()]
        for row, mask in zip(inputs["input_ids"], inputs["attention_mask"], strict=True)
    ]

    results: dict[str, Any] = {}
    for mode in args.modes.split(","):
        options = MODES[mode]
        kwargs = base_kwargs | {k: v for k, v in options.items() if v}

        def hf(features: list[str] | None, kwargs: dict[str, Any] = kwargs) -> Callable[[], Any]:
            def call() -> Any:
                scope = fastgen.unpatched() if features is None else fastgen.patched(features)
                with scope, torch.inference_mode():
                    return model.generate(**inputs, **kwargs)

            return call

        def ct2(options: dict[str, Any] = options, kwargs: dict[str, Any] = kwargs, compute: str = "float32") -> Any:
            return translators[compute].translate_batch(
                source,
                beam_size=options["num_beams"],
                no_repeat_ngram_size=options.get("no_repeat_ngram_size", 0),
                length_penalty=kwargs.get("length_penalty", 1.0),
                min_decoding_length=n,
                max_decoding_length=n,
                return_scores=False,
            )

        candidates: dict[str, Callable[[], Any]] = {
            "upstream": hf(None),
            "fastgen_without_gemm": hf(ALL_BUT_GEMM),
            "fastgen": hf(DEFAULT),
            "fastgen_fast": hf(FAST),
            "fastgen_int8": hf(INT8),
        }
        if translator is not None:
            candidates["ctranslate2"] = ct2
            candidates["ctranslate2_int8"] = lambda ct2=ct2: ct2(compute="int8_float32")
        linear.forget_choices()
        outputs, warmup = {}, {}
        for name, candidate in candidates.items():
            start = time.perf_counter()
            outputs[name] = candidate()
            warmup[name] = time.perf_counter() - start
        wall: dict[str, list[float]] = {name: [] for name in candidates}
        cpu: dict[str, list[float]] = {name: [] for name in candidates}
        process_cpu: dict[str, list[float]] = {name: [] for name in candidates}
        load = [round(os.getloadavg()[0], 2)]
        for name in rotating_order(list(candidates), args.rounds):
            start, start_cpu, start_process = time.perf_counter(), time.thread_time(), time.process_time()
            outputs[name] = candidates[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - start_cpu)
            process_cpu[name].append(time.process_time() - start_process)
            load.append(round(os.getloadavg()[0], 2))
        medians = {name: statistics.median(values) for name, values in wall.items()}
        entry: dict[str, Any] = {
            "generate": kwargs,
            "wall_seconds": wall,
            "thread_cpu_seconds": cpu,
            # all threads of the process (CTranslate2 computes in its own): on a busy machine this is
            # the fairer measure, since waiting for a core is not counted
            "process_cpu_seconds": process_cpu,
            "median_process_cpu_seconds": {name: statistics.median(v) for name, v in process_cpu.items()},
            "median_wall_seconds": medians,
            "warmup_seconds": warmup,
            "load_average_1min": load,
            "speedup_vs_upstream": {k: medians["upstream"] / v for k, v in medians.items()},
            "identical_to_upstream": {
                k: torch.equal(outputs["upstream"], outputs[k]) for k in ("fastgen_without_gemm", "fastgen")
            },
            "gemm_choices": {str(k): v.form for k, v in linear.choices().items()},
        }
        for name, scope in (("fast_mode", packed_linears), ("int8_mode", int8_linears)):
            entry[f"{name}_vs_upstream"] = {
                "token_agreement": _agreement_ids(outputs["upstream"], outputs[f"fastgen_{name[:-5]}"]),
                "rows_identical": _rows_identical(outputs["upstream"], outputs[f"fastgen_{name[:-5]}"]),
                **_logit_difference(model, inputs, outputs["upstream"], scope),
            }
        if translator is not None:
            entry["fastgen_over_ctranslate2"] = medians["ctranslate2"] / medians["fastgen"]
            entry["fastgen_fast_over_ctranslate2"] = medians["ctranslate2"] / medians["fastgen_fast"]
            entry["ctranslate2_token_agreement"] = _agreement(outputs["upstream"], outputs["ctranslate2"], names)
            entry["fastgen_int8_over_ctranslate2_int8"] = medians["ctranslate2_int8"] / medians["fastgen_int8"]
            entry["ctranslate2_int8_token_agreement"] = _agreement(
                outputs["upstream"], outputs["ctranslate2_int8"], names
            )
        results[mode] = entry
        sys.stdout.write(
            f"{args.scenario} {mode} threads={args.threads}: "
            + ", ".join(f"{k} {v:.3f}s" for k, v in medians.items())
            + "; process CPU: "
            + ", ".join(f"{k} {v:.3f}s" for k, v in entry["median_process_cpu_seconds"].items())
            + (
                f"; fastgen/ct2 {entry['fastgen_over_ctranslate2']:.2f}x, fast/ct2 "
                f"{entry['fastgen_fast_over_ctranslate2']:.2f}x, int8/ct2-int8 "
                f"{entry['fastgen_int8_over_ctranslate2_int8']:.2f}x"
                if translator is not None
                else ""
            )
            + f"; fast mode {entry['fast_mode_vs_upstream']}; int8 mode {entry['int8_mode_vs_upstream']}"
            + f"; identical {entry['identical_to_upstream']}; load {load[0]}..{load[-1]}\n"
        )
        sys.stdout.flush()

    report = {
        "benchmark": "ctranslate2_compare",
        "command": "python -m benchmarks.ctranslate2_compare " + " ".join(sys.argv[1:] if argv is None else argv),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "scenario": args.scenario,
        "settings": settings,
        "threads": args.threads,
        "ctranslate2": getattr(ctranslate2, "__version__", None),
        "environment": environment("cpu"),
        "cpu_isa": cpu_isa(),
        # fastgen's fast modes set glibc's malloc thresholds at their first call (fastgen.cli.heap): from
        # then on every candidate of this process, upstream and CTranslate2 included, runs with them
        "malloc_thresholds_set_by_fastgen": bool(linear_modes._heap_tuned and linear_modes._heap_tuned[0]),
        "cpu_kernels": cpu_kernels.unavailable_reason() or "loaded (fastgen.ops.cpu_kernels)",
        "modes": results,
    }
    out = args.out or Path(__file__).resolve().parent / "results" / f"ctranslate2-{args.scenario}-{args.threads}t.json"
    out.write_text(json.dumps(report, indent=2) + "\n")


def _agreement_ids(upstream: torch.Tensor, other: torch.Tensor) -> float:
    """Share of positions where two id tensors of one shape agree."""
    return (upstream == other).float().mean().item() if upstream.shape == other.shape else 0.0


def _rows_identical(upstream: torch.Tensor, other: torch.Tensor) -> str:
    same = (upstream == other).all(dim=1).sum().item() if upstream.shape == other.shape else 0
    return f"{same}/{upstream.shape[0]}"


def _logit_difference(
    model: Any, inputs: dict[str, torch.Tensor], sequences: torch.Tensor, scope: Callable[[Any], Any]
) -> dict[str, float]:
    """Max |logit difference| of a mode vs upstream, teacher-forced on upstream's sequences."""
    with torch.inference_mode():
        with fastgen.unpatched():
            reference = model(**inputs, decoder_input_ids=sequences).logits
        with scope(model):
            fast = model(**inputs, decoder_input_ids=sequences).logits
    return {
        "max_abs_logit_difference": (reference - fast).abs().max().item(),
        "max_abs_logit": reference.abs().max().item(),
        "argmax_agreement": (reference.argmax(-1) == fast.argmax(-1)).float().mean().item(),
    }


def _agreement(upstream: torch.Tensor, translated: list[Any], names: dict[int, str]) -> float:
    """Share of generated positions where CTranslate2's best hypothesis has upstream's token."""
    ids = {name: i for i, name in names.items()}
    same = total = 0
    for row, result in zip(upstream.tolist(), translated, strict=True):
        theirs = [ids.get(token, -1) for token in result.hypotheses[0]]
        ours = row[1:]  # without the decoder start token
        for a, b in zip(ours, theirs, strict=False):
            same += a == b
        total += max(len(ours), len(theirs))
    return same / total if total else 1.0


if __name__ == "__main__":
    main()


def _ratio(ctranslate2_seconds: float | None, seconds: float) -> str:
    return f"{ctranslate2_seconds / seconds:.2f}×" if ctranslate2_seconds else "–"


def _seconds(value: float | None) -> str:
    return f"{value:.2f} s" if value else "–"


def _tokens(agreement: dict[str, Any] | None) -> str:
    return f"{100 * agreement['token_agreement']:.1f}%" if agreement else "–"


def readme_table(results_dir: Path | None = None) -> str:
    """The table of every ``ctranslate2-*.json`` result (``python -m benchmarks.report`` writes it).

    Results from before the int8 rows (no ``fastgen_int8``, no ``cpu_isa``) show "–" there.
    """
    results_dir = results_dir or Path(__file__).resolve().parent / "results"
    lines = [
        "| model | mode | threads | CPU ISA | upstream | fastgen exact (default) | fastgen fast_gemm | fastgen int8 "
        "| CT2 fp32 | CT2 int8 | exact / CT2 fp32 | fast / CT2 fp32 | int8 / CT2 int8 | exact identical "
        "| tokens = upstream: fast / int8 / CT2 int8 | load (1 min) | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(results_dir.glob("ctranslate2-*.json")):
        r = json.loads(path.read_text())
        isa = r.get("cpu_isa")
        isa_text = "AVX-512" if isa and "avx512f" in isa else ("AVX2" if isa else "not recorded")
        if isa and ("avx512_vnni" in isa or "avx_vnni" in isa):
            isa_text += " VNNI"
        for mode, e in r["modes"].items():
            m = e["median_wall_seconds"]
            ct2, ct2_int8 = m.get("ctranslate2"), m.get("ctranslate2_int8")
            identical = "yes" if all(e["identical_to_upstream"].values()) else "NO"
            load = e["load_average_1min"]
            ct2_int8_tokens = e.get("ctranslate2_int8_token_agreement")
            lines.append(
                f"| {r['scenario']} | {mode} | {r['threads']} | {isa_text} | {m['upstream']:.2f} s "
                f"| {m['fastgen']:.2f} s | {m['fastgen_fast']:.2f} s | {_seconds(m.get('fastgen_int8'))} "
                f"| {_seconds(ct2)} | {_seconds(ct2_int8)} | {_ratio(ct2, m['fastgen'])} "
                f"| {_ratio(ct2, m['fastgen_fast'])} "
                f"| {_ratio(ct2_int8, m['fastgen_int8']) if 'fastgen_int8' in m else '–'} | {identical} "
                f"| {_tokens(e.get('fast_mode_vs_upstream'))} / {_tokens(e.get('int8_mode_vs_upstream'))} / "
                f"{f'{100 * ct2_int8_tokens:.1f}%' if ct2_int8_tokens is not None else '–'} "
                f"| {min(load):.1f}–{max(load):.1f} | {r.get('environment', {}).get('git_commit') or '?'} |"
            )
    return "\n".join(lines)
