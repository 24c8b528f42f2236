"""shoal's HTTP server: FastAPI app, protocol adapters, SSE, access and limits."""

from shoal.server.app import create_app
from shoal.server.settings import ServerSettings

__all__ = ["create_app", "ServerSettings"]
