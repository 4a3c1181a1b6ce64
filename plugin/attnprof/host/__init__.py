"""The plugin host: attnprof's side of a serving process around the hooks.

Capture measures inside the model step and hands typed records on; the host is everything
the server sees of attnprof: the routes, the API server's RPC calls and the workers' answers,
the live view and live trace, the stat logger that feeds them, and the export loop's wiring.
It may import every inner room (capture, aggregate, analyze, exporters); only the package's
entry points (vLLM's plugin groups), ``attnprof``'s public face, cli and tools import it.
"""
