"""The Lightning layer: :class:`UnifiedStrategy` runs any scheme of the schedule engine inside
Lightning's ``Trainer`` (registered with Lightning's ``StrategyRegistry`` as ``"unified"``)."""

from .precision import clip_by_global_norm
from .strategy import UnifiedStrategy

__all__ = ["UnifiedStrategy", "clip_by_global_norm"]
