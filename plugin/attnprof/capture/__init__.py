"""capture: the hooks. vLLM (attention implementations, step boundaries, stat logger,
snapshot route) and Hugging Face transformers (attention-function registry), plus the SDPA
dispatcher spy. A hook decides (one branch when unsampled), measures, and hands a typed
record to a recorder in :mod:`attnprof.aggregate`; nothing else happens here.
"""
