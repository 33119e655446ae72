"""What several test modules share: tiny models and recipes, runs through the loop or the
command line, worker processes for gloo ranks, vLLM servers, faulty user code."""
