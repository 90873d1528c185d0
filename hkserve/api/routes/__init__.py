"""The HTTP routes, one APIRouter per module; each reads the app's ServerContext (api/context.py)."""
