"""EPLB logic in vLLM's vocabulary: expert placement (physical_to_logical / logical_to_physical), the expert_load
window, the rebalance policy and the per-layer weight-move plan.  Pure and deterministic (numpy; torch tensors are
only touched through their methods), independent of the simulator and of NIXL."""
