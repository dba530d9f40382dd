"""The OpenAI-compatible face: routes, schemas, SSE, choices, tools, structured output, batch."""
