"""dcpx's version, ``dcpx.__version__`` (imports nothing: ``dcpx --version``
imports no torch)."""
__version__ = "0.1.0"
