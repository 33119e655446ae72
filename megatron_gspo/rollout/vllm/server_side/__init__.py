"""Inside vLLM's processes: what the project's vLLM plugin puts into every server (the API
server, the engine core, each worker). Nothing here runs in the trainer."""
