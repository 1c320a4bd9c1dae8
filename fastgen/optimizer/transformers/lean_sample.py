"""The lean decode step under upstream's greedy and sampling loop (feature ``lean_step``).

Upstream's ``GenerationMixin._sample`` calls the model once per new token. For one such call the model
gets an instance ``forward`` that sends each one-token decode step through
:class:`fastgen.models.lean_step.LeanDecodeStep` (upstream's logits bit for bit, without the module tree's
glue) and everything else, the prefill included, through the class's own ``forward``. The loop itself
(processors, sampling and its random draws, stopping criteria, streamers, outputs) stays upstream's, so
greedy and sampling with a seed give upstream's tokens. fastgen's beam loop uses the same step (feature
``beam``); ``FASTGEN_LEAN_STEP=0`` turns both off.

The forward serves only the thread that installed it (another thread's call on the same model meanwhile
runs the class's forward) and is removed when the call ends, as are the in-place self-attention layers
(the returned cache is upstream's plain one). A model the step does not reproduce, a compiled forward, or
a forward someone else put on the instance keeps upstream's loop untouched (noted in the report).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastgen.optimizer import report
from fastgen.optimizer.transformers.beam_search import LEAN_ENV, _StepOutputs, lean_step_switched_off

FEATURE = "lean_step"


def _problem(model: Any, generation_config: Any, model_kwargs: dict[str, Any], synced_gpus: bool) -> str | None:
    """Why this ``_sample`` call keeps the model's own forward at every step (None: the lean step can serve)."""
    # imported here: they import transformers.modeling_utils, not at this module's import
    from fastgen.models import decoder_graph_step, lean_step

    if lean_step_switched_off():
        return f"{LEAN_ENV}=0"
    if model.config.is_encoder_decoder:
        reason = lean_step.model_problem(model)
    else:
        reason = decoder_graph_step.call_problem(model)
    if reason is not None:
        return reason
    if synced_gpus:
        return "synced_gpus"
    if getattr(model, "device", None) is None or model.device.type not in ("cpu", "cuda"):
        return f"a model on {getattr(model, 'device', None)}"
    if "forward" in model.__dict__:
        return "the model carries an instance forward (its own, or another call's in another thread)"
    if model._valid_auto_compile_criteria(model_kwargs, generation_config):
        return "Transformers compiles the forward for this call"
    return None


@contextmanager
def _forward_through(model: Any, step: Any, finish: bool = True) -> Iterator[None]:
    """Inside the block, this thread's one-token decode steps of ``model`` run ``step`` (``finish``: the call
    ends with the block)."""
    owner = threading.get_ident()
    own_forward = type(model).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not args and threading.get_ident() == owner and kwargs.get("return_dict", True) is True:
            stepped = step.step({name: value for name, value in kwargs.items() if name != "return_dict"})
            if stepped is not None:
                return _StepOutputs(logits=stepped[0], cache=stepped[1])
        return own_forward(model, *args, **kwargs)

    model.__dict__["forward"] = forward  # what nn.Module.__setattr__ does for a plain attribute, minus its checks
    try:
        yield
    finally:
        if model.__dict__.get("forward") is forward:
            del model.__dict__["forward"]
        if finish:
            step.finish()


def make_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    def _sample(
        self: Any,
        input_ids: Any,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: Any,
        synced_gpus: bool = False,
        streamer: Any = None,
        **model_kwargs: Any,
    ) -> Any:
        def run() -> Any:
            return original(
                self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
                **model_kwargs,
            )  # fmt: skip

        reason = _problem(self, generation_config, model_kwargs, synced_gpus)
        if reason is not None:
            report.note_ran(FEATURE, f"decode step: upstream's forward ({reason})")
            return run()
        from fastgen.models import decoder_graph_step, lean_step

        if self.config.is_encoder_decoder:
            report.note_ran(FEATURE, "decode step: the lean BART-family step")
            step = lean_step.LeanDecodeStep(self, generation_config.max_length)
        else:
            step = decoder_graph_step.decode_step(self, generation_config.max_length)
            if step is None:
                return run()
        with _forward_through(self, step):
            return run()

    return _sample
