"""Cost model: per-op compute time (measured or roofline) and collective communication."""

from meshplace.cost.collectives import collective_time, schedule_graph
from meshplace.cost.compute import DEFAULT_EFFICIENCY, CostModel

__all__ = ["DEFAULT_EFFICIENCY", "CostModel", "collective_time", "schedule_graph"]
