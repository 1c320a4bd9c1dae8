"""fairseq-generate's per-sentence post-processing, runnable in a worker process.

``offload_batch`` (main process, offload thread) turns a finished batch into plain data: token
ids, and the base-2 scores computed with the very tensor ops ``fairseq_cli.generate`` uses, so
their printed digits are the same. ``format_batch`` (worker) rebuilds fairseq-generate's
S-/T-/H-/D-/P-/A-/I-/E- lines from it with the task's dictionaries, BPE and tokenizer, and returns
what scoring needs. Scoring itself is replayed in order in the main process (``replay_scores``):
fairseq's scorers are stateful and ``Dictionary.encode_line(add_if_not_exist=True)`` grows the
target dictionary, so it must run once, in fairseq's order.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_STATE: dict[str, Any] = {}


def set_state(state: dict[str, Any]) -> None:
    """Install the dictionaries/BPE/tokenizer/options that ``format_batch`` uses (worker initializer)."""
    _STATE.clear()
    _STATE.update(state)


def warm_worker() -> None:
    """Worker initializer: pay for ``import fairseq`` while the main process loads the model."""
    torch.set_num_threads(1)
    import fairseq  # noqa: F401


def _ensure_state(state_file: str | None) -> None:
    """Workers start before the task exists; they read its pickled state once, on first use."""
    if state_file is None or _STATE.get("_file") == state_file:
        return
    import pickle

    with open(state_file, "rb") as handle:
        set_state(pickle.load(handle))
    _STATE["_file"] = state_file


def offload_batch(sample: dict[str, Any], hypos: list[list[dict[str, Any]]], ctx: dict[str, Any]) -> dict[str, Any]:
    """One batch as picklable data, with one device->host copy per tensor kind."""
    nbest = ctx["nbest"]
    pad = ctx["pad"]
    log2 = math.log(2)
    top = [hyps[:nbest] for hyps in hypos]
    flat = [h for hyps in top for h in hyps]
    # fairseq-generate prints `hypo["score"] / math.log(2)` and `positional_scores.div_(math.log(2))`;
    # the same elementwise ops on a concatenation give the same float32 values, in one transfer.
    scores = (torch.stack([h["score"] for h in flat]) / log2).cpu().tolist() if flat else []
    positional = torch.cat([h["positional_scores"] for h in flat]).div_(log2).cpu().tolist() if flat else []
    tokens = torch.cat([h["tokens"] for h in flat]).int().cpu().tolist() if flat else []
    src_tokens = sample["net_input"].get("src_tokens")
    src_rows = src_tokens.cpu() if src_tokens is not None else None
    target = sample.get("target")
    target_rows = target.cpu() if target is not None else None
    sentences = []
    tok_at = 0
    hyp_at = 0
    for i, sample_id in enumerate(sample["id"].tolist()):
        sentence: dict[str, Any] = {"id": sample_id, "has_target": target_rows is not None}
        if src_rows is not None:
            sentence["src"] = src_rows[i][src_rows[i].ne(pad)].tolist()
        if target_rows is not None:
            sentence["tgt"] = target_rows[i][target_rows[i].ne(pad)].tolist()
        if ctx.get("original_text") is not None:
            sentence["src_text"], sentence["tgt_text"] = ctx["original_text"](sample_id)
        out_hypos = []
        for hypo in top[i]:
            n = hypo["tokens"].numel()
            entry: dict[str, Any] = {
                "tokens": tokens[tok_at : tok_at + n],
                "score": scores[hyp_at],
                "positional": positional[tok_at : tok_at + n],
                "alignment": _plain(hypo.get("alignment")),
            }
            if ctx["print_step"]:
                entry["steps"] = hypo["steps"]
            if ctx["retain_iter_history"]:
                entry["history"] = [h["tokens"].int().cpu().tolist() for h in hypo["history"]]
            out_hypos.append(entry)
            tok_at += n
            hyp_at += 1
        sentence["hypos"] = out_hypos
        sentences.append(sentence)
    return {"sentences": sentences, "ntokens": sum(len(h[0]["tokens"]) for h in hypos if h)}


def _plain(value: Any) -> Any:
    return value.cpu().tolist() if torch.is_tensor(value) else value


def format_batch(payload: dict[str, Any]) -> dict[str, Any]:
    """fairseq-generate's lines for one batch, and the inputs its scorer needs."""
    from fairseq import utils

    _ensure_state(payload.get("state_file"))
    st = _STATE
    src_dict, tgt_dict = st["src_dict"], st["tgt_dict"]
    post_process, strip = st["post_process"], st["symbols_to_strip"]
    lines: list[str] = []
    scores: list[dict[str, Any]] = []

    def decode(x: str) -> str:
        if st["bpe"] is not None:
            x = st["bpe"].decode(x)
        if st["tokenizer"] is not None:
            x = st["tokenizer"].decode(x)
        return x

    for sent in payload["sentences"]:
        sid = sent["id"]
        has_target = sent["has_target"]
        target_str = None
        if st["align_dict"] is not None:
            src_str, target_str = sent["src_text"], sent["tgt_text"]
        else:
            src_str = src_dict.string(torch.tensor(sent["src"]), post_process) if src_dict is not None else ""
            if has_target:
                target_str = tgt_dict.string(
                    torch.tensor(sent["tgt"], dtype=torch.int32),
                    post_process,
                    escape_unk=True,
                    extra_symbols_to_ignore=strip,
                )
        src_str = decode(src_str)
        if has_target:
            target_str = decode(target_str)
        if not st["quiet"]:
            if src_dict is not None:
                lines.append(f"S-{sid}\t{src_str}")
            if has_target:
                lines.append(f"T-{sid}\t{target_str}")
        item: dict[str, Any] = {"has_target": has_target, "target_str": target_str, "hypo_strs": []}
        for j, hypo in enumerate(sent["hypos"]):
            hypo_tokens = torch.tensor(hypo["tokens"], dtype=torch.int32)
            hypo_str = tgt_dict.string(hypo_tokens, post_process, extra_symbols_to_ignore=strip)
            if st["align_dict"] is not None:
                hypo_str = utils.replace_unk(
                    hypo_str, src_str, hypo["alignment"], st["align_dict"], tgt_dict.unk_string()
                )
            item["hypo_strs"].append(hypo_str)
            detok = decode(hypo_str)
            if not st["quiet"]:
                _hypo_lines(lines, sid, hypo, hypo_str, detok, st)
            if j == 0:
                item["detok"] = detok
                item["hypo_tokens"] = hypo["tokens"]
                item["target_tokens"] = sent.get("tgt")
        scores.append(item)
    text = "".join(line + "\n" for line in lines)
    return {
        "text": text,
        "scores": scores,
        "ntokens": payload["ntokens"],
        "nsentences": len(payload["sentences"]),
        "meta": payload.get("meta"),
    }


def _hypo_lines(lines: list[str], sid: int, hypo: dict[str, Any], hypo_str: str, detok: str, st: dict) -> None:
    score = hypo["score"]
    lines.append(f"H-{sid}\t{score}\t{hypo_str}")
    lines.append(f"D-{sid}\t{score}\t{detok}")
    lines.append(f"P-{sid}\t" + " ".join(f"{x:.4f}" for x in hypo["positional"]))
    alignment = hypo["alignment"]
    if st["print_alignment"] == "hard":
        lines.append(f"A-{sid}\t" + " ".join(f"{s}-{t}" for s, t in alignment))
    if st["print_alignment"] == "soft":
        lines.append(f"A-{sid}\t" + " ".join(",".join(probs) for probs in alignment))
    if st["print_step"]:
        lines.append(f"I-{sid}\t{hypo['steps']}")
    if st["retain_iter_history"]:
        tgt_dict = st["tgt_dict"]
        for step, tokens in enumerate(hypo["history"]):
            h_str = tgt_dict.string(torch.tensor(tokens, dtype=torch.int32), None)
            lines.append(f"E-{sid}_{step}\t{h_str}")


def replay_scores(scorer: Any, tgt_dict: Any, items: list[dict[str, Any]], reencode: bool) -> bool:
    """Feed the scorer in fairseq-generate's order; returns fairseq's final ``has_target``."""
    has_target = True
    for item in items:
        has_target = item["has_target"]
        if not has_target:
            continue
        hypo_strs = item["hypo_strs"]
        if reencode:
            # fairseq grows tgt_dict in this order: hypo 0 (post_process_prediction), the target,
            # the detokenized hypo 0, then hypos 1.. ; ids only matter for the token scorer.
            tgt_dict.encode_line(hypo_strs[0], add_if_not_exist=True)
            target_tokens = tgt_dict.encode_line(item["target_str"], add_if_not_exist=True)
            hypo_tokens = tgt_dict.encode_line(item["detok"], add_if_not_exist=True)
            for hypo_str in hypo_strs[1:]:
                tgt_dict.encode_line(hypo_str, add_if_not_exist=True)
        else:
            target_tokens = torch.tensor(item["target_tokens"], dtype=torch.int32)
            hypo_tokens = torch.tensor(item["hypo_tokens"], dtype=torch.int32)
        if hasattr(scorer, "add_string"):
            scorer.add_string(item["target_str"], item["detok"])
        else:
            scorer.add(target_tokens, hypo_tokens)
    return has_target
