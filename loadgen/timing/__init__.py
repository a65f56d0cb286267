"""The timing client: requests sent and their answers timed as the bytes arrive (the streaming
OpenAI client, SSE, token checks, the event loop's lag), and the sink their records go to."""
