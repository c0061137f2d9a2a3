"""The protocols the gateway speaks: native, KServe v2, OpenAI (embeddings, chat and completions)."""
