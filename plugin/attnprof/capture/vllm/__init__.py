"""The hooks inside vLLM: decide, measure, hand typed records to the aggregate room.

What patches vLLM (:mod:`.install`), reads its arguments (:mod:`.args`) and learns the model
(:mod:`.model_info`). The plugin host around them (entry points, routes, RPC answers, live
view) is :mod:`attnprof.host.vllm`; capture never imports it.
"""
