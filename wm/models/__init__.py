"""The models and what only they use: the tokenizer, the world model, shared layers, the Lovasz loss, rollout caches, Triton kernels."""
