"""Event-driven simulation of a placed op graph on a cluster, and its Chrome trace."""

from meshplace.sim.simulator import OBJECTIVES, SimResult, Simulator
from meshplace.sim.trace import chrome_trace, write_chrome_trace

__all__ = ["OBJECTIVES", "SimResult", "Simulator", "chrome_trace", "write_chrome_trace"]
