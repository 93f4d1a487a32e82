"""Speculative decoding: the rejection sampler and the proposers (drafters) behind one protocol."""
