"""Developer tools (tiny checkpoint generator, ...)."""
