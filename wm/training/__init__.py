"""Training: the stages, the loop and its step, batching, the optimizer, memory plan, compile cache, token cache."""
