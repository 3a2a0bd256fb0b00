"""A fleet in a discrete-event model, calibrated from the engine's own step costs: capacity beyond this machine.

    cost = StepCost.load()                               # the shipped fit of Engine.steps (or measure() here)
    result = simulate(make_trace(seed=0), replicas=3, policy="cache_aware", cores=2)
    result.summary.line()                                # what a real replay would print, from the model
    rows = compare(make_trace(seed=0), (1, 2, 3))        # real fleets against the model (starts servers: minutes)
    capacity_table(scaled_trace(2000, 20), POLICIES)     # replicas for TTFT p99 < 1 s, per policy, CPU and GPU-like

Modules, in the order a reader meets them:

    cost      the step cost: a linear fit of measured steps (StepCost, measure, fit), the shipped JSON, GpuLikeCost
    router    vllm-router's five policies as the model routes (each from the router's own code), the radix tree,
              the blocks a replica's KV events tell
    replica   one slot server: the engine's own slot choice and prompt cache on a KV cache of token counts, its loop a
              simpy process whose steps cost what the fit says, slowed when replicas share too few cores
    run       the trace's users as processes, the fleet, simulate() -> trace.Records (trace.summarize reads them)
    check     the model against real fleets of 1-3 replicas (llmkit.course.fleet), the error in %
    capacity  replicas for a TTFT SLO at thousands of users, per policy, on the CPU curve and a GPU-like one

Why simpy: a replica's engine loop and a user's conversation are each a process that waits (for work, for a step's
time, for an answer, for a think time), and simpy writes them as the loops they are, ``Replica.loop`` beside
``Engine.loop``; a heap of callbacks would split each loop at every wait. It is small, pure Python, and only a clock
and events here (no resources, no statistics): what the model computes, it computes in llmkit's own code.
"""

from llmkit.course.sim.capacity import Capacity, capacity_markdown, capacity_table, plot_capacity, replicas_for_slo, scaled_trace
from llmkit.course.sim.check import Comparison, compare, plot_check, table
from llmkit.course.sim.cost import GpuLikeCost, StepCost, describe, fit, measure, plot_fit
from llmkit.course.sim.replica import Replica, ReplicaConfig
from llmkit.course.sim.router import POLICIES
from llmkit.course.sim.run import Answers, SimResult, answer_lengths, simulate

__all__ = [
    "POLICIES", "Answers", "Capacity", "Comparison", "GpuLikeCost", "Replica", "ReplicaConfig", "SimResult", "StepCost",
    "answer_lengths", "capacity_markdown", "capacity_table", "compare", "describe", "fit", "measure", "plot_capacity",
    "plot_check", "plot_fit", "replicas_for_slo", "scaled_trace", "simulate", "table",
]  # fmt: skip
