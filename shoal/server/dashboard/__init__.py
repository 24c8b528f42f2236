"""The dashboard page and its files, served by the server itself (server/app.py)."""
