"""fairseq ``SequenceGenerator``: encoder output kept once per input, not once per beam.

Upstream expands ``encoder_out`` to B·M rows before decoding and ``index_select``s it at
every step. Here ``_generate`` marks the ensemble as deduplicated for the duration of one
call (and makes its cross-attention beamable), and ``EnsembleModel.reorder_encoder_out``
then leaves the B-row encoder output alone, except to drop inputs whose sentences finished.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastgen.models.fairseq_transformer import already_beamable, beamable_cross_attention, unsupported_reason
from fastgen.optimizer import report
from fastgen.optimizer.registry import fallback

FEATURE = "dedup"
_BEAM_ATTR = "_fastgen_shared_encoder_beam"


def make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    from fairseq.sequence_generator import EnsembleModel, SequenceGenerator

    def _generate(self: Any, sample: Any, *args: Any, **kwargs: Any) -> Any:
        beam = self.beam_size
        if beam <= 1 or not self.model.has_encoder() or already_beamable(self.model.models):
            return original(self, sample, *args, **kwargs)  # nothing to share, or upstream already does
        if type(self) is not SequenceGenerator or type(self.model) is not EnsembleModel:
            pair = f"{type(self).__name__}/{type(self.model).__name__}"
            fallback(FEATURE, f"{pair} is not fairseq's SequenceGenerator/EnsembleModel (exact classes)")
            return original(self, sample, *args, **kwargs)
        reason = unsupported_reason(self.model.models)
        if reason:
            fallback(FEATURE, reason)
            return original(self, sample, *args, **kwargs)
        report.note_ran(FEATURE, f"encoder output and cross-attention K/V shared by {beam} beams per input")
        setattr(self.model, _BEAM_ATTR, beam)
        try:
            with beamable_cross_attention(self.model.models, beam):
                return original(self, sample, *args, **kwargs)
        finally:
            delattr(self.model, _BEAM_ATTR)

    return _generate


def make_reorder_encoder_out(original: Callable[..., Any]) -> Callable[..., Any]:
    def reorder_encoder_out(self: Any, encoder_outs: Any, new_order: Any) -> Any:
        beam = getattr(self, _BEAM_ATTR, 0)
        if not beam or not encoder_outs:
            return original(self, encoder_outs, new_order)
        inputs = encoder_outs[0]["encoder_out"][0].size(1) if encoder_outs[0]["encoder_out"] else None
        if inputs is None:
            return original(self, encoder_outs, new_order)
        if new_order.numel() == inputs * beam:
            # The initial expansion, or a reorder among the beams of each input: every beam of
            # an input shares its encoder output, so nothing moves.
            return encoder_outs
        # Finished sentences left the batch: new_order indexes the previous B·M rows; keep the
        # inputs whose beams survive.
        return original(self, encoder_outs, new_order.view(-1, beam)[:, 0] // beam)

    return reorder_encoder_out
