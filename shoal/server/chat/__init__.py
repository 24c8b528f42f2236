"""What every protocol adapter shares, whatever its wire format: rendering a conversation
into a prompt (`render`, over `shoal.chat_template`, which the offline `LLM` uses too), splitting
reasoning from the answer (`reasoning`), and turning the model's text into tool calls (`tools`).

Adapters (`server/openai/`, `server/anthropic/`) translate their messages into the
template's message dicts and their tools into OpenAI-style function definitions (what
chat templates expect), and read calls back as `tools.ToolCall`s.
"""
