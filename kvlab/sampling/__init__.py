"""Sampling: SamplingParams and the Sampler (logits to token ids), and which settings a run uses."""
