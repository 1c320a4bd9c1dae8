"""Whether a module's call runs hooks: a fast path that skips or fuses the module must then step aside."""

from __future__ import annotations

import torch


def hooked(module: torch.nn.Module) -> bool:
    """``module`` has forward or backward hooks of its own, or every module has global forward hooks."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or torch.nn.modules.module._global_forward_hooks
        or torch.nn.modules.module._global_forward_pre_hooks
    )
