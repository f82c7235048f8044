"""miles' session server and agentic generate (token in, token out for agents on the OpenAI API): docs/openai.md."""
