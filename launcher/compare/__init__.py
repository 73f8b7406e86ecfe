"""The comparison dashboard: ``python -m launcher.compare <sweep or run dirs>`` writes one
self-contained HTML page that puts training runs side by side (:mod:`.runs` finds and reads them,
:mod:`.charts` draws the interactive figures with plotly, :mod:`.page` renders the page with Jinja2,
plotly.js embedded once: it works offline from ``file://``)."""

from .page import build

__all__ = ["build"]
