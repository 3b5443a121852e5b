"""The HTTP front door: OpenAI's and Ollama's APIs over one engine."""
