"""``odb tune``: L_max from memory. Builds the user's model (:mod:`.model`), measures the peak
memory of a training step on the worst shapes each budget admits (:mod:`.shapes`,
:mod:`.measure`) and reports the largest budget that fits (:mod:`.search`)."""

from odb_tools.tune.search import markdown, parse_bytes, tune

__all__ = ["markdown", "parse_bytes", "tune"]
