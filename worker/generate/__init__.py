"""Text generation: a causal LM served with continuous batching inside a KV-cache memory plan.

sequence.py (one sequence's tokens, text deltas, stop strings; pure Python), sampling.py (greedy
and seeded sampling with transformers' logits warpers), kvpool.py (the KV pool of fixed-size
blocks: transformers' PagedAttentionCache), engine.py (a step: token budget, admission,
preemption), causal_lm.py (the Hugging Face causal LM backend: one packed step over the pool),
kvplan.py and kvmeasure.py (the pool's plan and the probe steps it is measured from), progress.py
(a sequence's progress in Redis) and server.py (the serve loop the worker runs for a generative model).
"""
