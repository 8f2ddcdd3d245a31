"""Plans: placements of ops or co-location groups on devices, validated against a graph."""

from meshplace.plan.placement import Plan, PlanError, graph_fingerprint, load_plan, save_plan

__all__ = ["Plan", "PlanError", "graph_fingerprint", "load_plan", "save_plan"]
