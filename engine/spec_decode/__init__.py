"""Speculative decoding: the speculation policy (speculator.py, reading cost_model.py,
acceptance.py and tree_policy.py), the rejection sampler, and the proposers (drafters) behind one
protocol."""
