"""How many tokens the draft model proposes per step, for a whole batch (one length per step).

``bass`` (default) is Algorithm 1 of BASS (Qian et al. 2024): grow by ``increment`` when some row
accepted every draft, else shrink by ``ceil(l / mod)`` plus 1 on consecutive shrinks, never below
the most drafts any row accepted (nor 1). ``heuristic`` is Transformers' batch-1 rule applied to the
batch's best row (+2 when all drafts of some row were accepted, else -1). ``constant`` keeps the
initial length. Settings come from ``generation_config`` attributes (``GenerationConfig`` keeps
unknown attributes), documented in docs/guides/speculative.md:

- ``fastgen_draft_schedule``: ``"bass"`` | ``"heuristic"`` | ``"constant"``
- ``fastgen_draft_length``: initial length (default 7 for bass, else the assistant's ``num_assistant_tokens``)
- ``fastgen_draft_increment``, ``fastgen_draft_mod``, ``fastgen_draft_limit``: BASS's l_incre, l_mod, l_limit
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SCHEDULES = ("bass", "heuristic", "constant")


#: The positive-integer settings (``fastgen_draft_schedule`` is checked against :data:`SCHEDULES`).
INTEGER_OPTIONS = ("fastgen_draft_length", "fastgen_draft_increment", "fastgen_draft_mod", "fastgen_draft_limit")


def check_options(generation_config: Any) -> None:
    """Raise ValueError naming a fastgen draft option set to a value it cannot take, and the valid values.

    A typo in fastgen's own option is the user's mistake to hear about, not a reason to fall back."""
    schedule = getattr(generation_config, "fastgen_draft_schedule", None)
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"fastgen_draft_schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    for name in INTEGER_OPTIONS:
        value = getattr(generation_config, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer (or None for the default), got {value!r}")


@dataclasses.dataclass
class DraftLength:
    schedule: str = "bass"
    length: int = 7
    increment: int = 2
    mod: int = 10
    limit: int = 32
    _shrinking: int = 0

    @classmethod
    def from_config(cls, generation_config: Any, assistant_config: Any | None) -> DraftLength:
        schedule = getattr(generation_config, "fastgen_draft_schedule", None) or "bass"
        if schedule not in SCHEDULES:
            raise ValueError(f"fastgen_draft_schedule must be one of {SCHEDULES}, got {schedule!r}")
        default = 7
        if schedule != "bass":
            default = getattr(assistant_config, "num_assistant_tokens", None) or 20
        return cls(
            schedule=schedule,
            length=int(getattr(generation_config, "fastgen_draft_length", None) or default),
            increment=int(getattr(generation_config, "fastgen_draft_increment", None) or 2),
            mod=int(getattr(generation_config, "fastgen_draft_mod", None) or 10),
            limit=int(getattr(generation_config, "fastgen_draft_limit", None) or 32),
        )

    def update(self, drafted: int, accepted_max: int) -> None:
        """After a step that drafted ``drafted`` tokens and whose best row accepted ``accepted_max`` of them."""
        if self.schedule == "constant" or drafted == 0:
            return
        if self.schedule == "heuristic":
            self.length = self.length + 2 if accepted_max == drafted else max(1, self.length - 1)
            return
        if accepted_max == drafted:
            self.length = min(self.length + self.increment, self.limit)
            self._shrinking = 0
        else:
            self.length = self.length - math.ceil(self.length / self.mod) - self._shrinking
            self.length = max(1, accepted_max, self.length)
            self._shrinking = 1
