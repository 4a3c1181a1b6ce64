"""Attention diagnostics: which kernel ran and why, compatibility rules, advice, memory, scaling.

Submodules import torch lazily (only :mod:`sdpa`, :mod:`memory` and :mod:`scaling` need it),
so ``attnprof compat`` and the rule port work on machines without torch.
"""

from __future__ import annotations
