"""Text generation: a causal LM served with continuous batching inside a KV-cache memory plan.

sequence.py (one sequence's tokens, text deltas, stop strings; pure Python), sampling.py (greedy
and seeded sampling with transformers' logits warpers), kvbatch.py (the running batch's
DynamicCache: join, leave, one decode step), causal_lm.py (the Hugging Face causal LM backend),
kvplan.py (the KV-cache plan's arithmetic), progress.py (a sequence's progress in Redis) and
server.py (the serve loop the worker runs for a generative model).
"""
