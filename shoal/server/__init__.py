"""shoal's HTTP server: FastAPI app, protocol adapters, SSE, access and limits.

`create_app` and `ServerSettings` load on first use, so that `shoal.server.chat` (which
the offline `LLM.chat` renders with) does not import FastAPI.
"""

__all__ = ["create_app", "ServerSettings"]


def __getattr__(name: str):
    if name == "create_app":
        from shoal.server.app import create_app

        return create_app
    if name == "ServerSettings":
        from shoal.server.settings import ServerSettings

        return ServerSettings
    raise AttributeError(f"module 'shoal.server' has no attribute {name!r}")
