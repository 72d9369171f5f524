"""Not built yet: see the project's issues."""
