"""HTTP API (the only package that imports FastAPI): `create_app(settings)` builds one app instance."""

from service.api.app import create_app

__all__ = ["create_app"]
