"""servelab: a lab for LLM-serving scheduling.

One set of pure-Python components (scheduling policies, preemption strategies, KV-cache
block managers) drives two executors: a SimPy simulator with a roofline cost model and a
real backend with Triton paged-attention kernels.
"""
__version__ = "0.1.0"
