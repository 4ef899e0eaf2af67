"""pagoda: an LLM inference server."""
