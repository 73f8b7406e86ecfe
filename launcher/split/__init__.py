"""Cut one module into pipeline stages by tracing it, with no wrapper around the model.

:func:`split_module` traces ``forward`` on an example micro-batch (:mod:`.capture`) and cuts the
graph where given submodules begin, or where the parameter counts balance (:mod:`.cut`). This is
the ``split=`` key's code; ``split_backward`` (the backward as ``I`` and ``W`` jobs) is not here. The
stages share the module's parameters and follow the engine's stage contract; :func:`loss_module`
turns a LightningModule's ``training_step`` into a ``batch -> loss`` module to split whole.
"""

from launcher.split.capture import LossModule, SplitError, loss_module
from launcher.split.cut import Split, Traced, split_module, trace_module

__all__ = ["LossModule", "Split", "SplitError", "Traced", "loss_module", "split_module", "trace_module"]
