"""The package's version: a leaf module, so any layer (the service's model info, the client) can
read it without importing the package root's lazy API."""

__version__ = "0.1.0"
