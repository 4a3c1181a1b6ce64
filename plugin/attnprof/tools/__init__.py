"""tools: drivers that load models, start servers or generate traffic and then call the
capture and analyze rooms (offline profile runs, window replay, the embedded model cache,
the vLLM server launcher, synthetic traffic). Not imported by the serving path.
"""
