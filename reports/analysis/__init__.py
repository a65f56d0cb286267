"""What the figures say: capacity at SLO, overload, the Pareto frontier, prefix-cache checks,
engine counters, server traces, retention, history, the gate and the diagnosis."""
