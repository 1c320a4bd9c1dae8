"""The frameworks' patch tables, declared to the registry (DESIGN.md §8: the registry knows no framework).

Each framework's ``patches.py`` is data only (strings), so importing it imports neither the
framework nor fastgen's replacements; those load when a target module is imported.
"""

from fastgen.optimizer import registry
from fastgen.optimizer.fairseq.patches import PATCHES as FAIRSEQ_PATCHES
from fastgen.optimizer.transformers.patches import PATCHES as TRANSFORMERS_PATCHES

registry.declare([*TRANSFORMERS_PATCHES, *FAIRSEQ_PATCHES])
